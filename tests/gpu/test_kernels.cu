/* GPU kernels vs their CPU twins (kernels/ref/cpu_ref.c) on random inputs with odd sizes.
 *   test_kernels          run every comparison; ends with "N passed, N failed, N skipped"
 *   test_kernels --bench  also time the GEMVs (m40k_gemv, and m40k_gemv_q8 for the
 *                         quantized types) on 4096x14336 and 14336x4096 matrices of each
 *                         type and report GB/s against the H100's 3.02 TB/s copy bandwidth;
 *                         the tensor-core F16 GEMV against m40k_gemv and cuBLAS at 1..8 rows;
 *                         the int8-activation GEMV at a 7B decode step's shapes; and
 *                         decode attention. `--bench skinny attn`: only those (names:
 *                         gemv, gemvq8, skinny, attn, gemmq, gemmqfixed, deqov).
 *   test_kernels --bench-only [names]   the same benchmarks without the comparisons.
 *   M40_TEST_ONLY=gemv_q8,embed_g8 test_kernels   only the tests named (comma-separated).
 *   gemmq's benchmark: M40_BENCH_SHAPE=NxK one of its shapes, M40_BENCH_M=16,64 those row
 *   counts only.
 * Without a GPU: prints why, "0 passed, 0 failed, 1 skipped", exit 0. */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#include <vector>
#include <algorithm>

extern "C" {
#include "ref/ggml_types.h"
#include "ref/quant.h"
}
#include "ref/cpu_ref.h"
#include "model_aux.h"

#define GPU_CHECK_SEED 0x9E3779B97F4A7C15ull
#include "gpu_check.h"

static void check(const char *what, bool ok)
{
    if (ok)
        n_pass++;
    else
        n_fail++, printf("FAIL %s\n", what);
}
static std::vector<float> h2f(const std::vector<uint16_t> &h)
{
    std::vector<float> f(h.size());
    for (size_t i = 0; i < h.size(); i++)
        f[i] = m40_fp16_to_fp32(h[i]);
    return f;
}
static size_t row_bytes(int type, int n)
{
    const m40_type_info *ti = m40_type_get((uint32_t)type);
    return (size_t)n / ti->block_elems * ti->block_bytes;
}
/* Rows of random values quantized to type; for the types without a quantizer here (Q2_K,
 * Q3_K, Q5_K) random blocks: every bit pattern is a valid block but the F16 scales, which
 * are set to small positive values. */
static std::vector<uint8_t> quant_matrix(int type, int rows, int cols, float lo = -1, float hi = 1)
{
    std::vector<uint8_t> q(row_bytes(type, cols) * rows);
    for (int r = 0; r < rows; r++) {
        std::vector<float> f = rand_vec(cols, lo, hi);
        uint8_t *row = q.data() + r * row_bytes(type, cols);
        if (m40_quantize_row((uint32_t)type, f.data(), row, cols) == 0)
            continue;
        const int bb = m40_type_get((uint32_t)type)->block_bytes;
        std::vector<int> f16_at = type == M40K_TYPE_Q2_K   ? std::vector<int>{80, 82}
                                  : type == M40K_TYPE_Q3_K ? std::vector<int>{108}
                                  : type == M40K_TYPE_Q5_K ? std::vector<int>{0, 2}
                                                           : std::vector<int>{};
        if (f16_at.empty())
            abort(); /* a type this helper does not know */
        for (size_t i = 0; i < row_bytes(type, cols); i++)
            row[i] = (uint8_t)rnd32();
        for (size_t b = 0; b < row_bytes(type, cols); b += bb)
            for (int o : f16_at) {
                const uint16_t h = m40_fp32_to_fp16(0.001f + 0.004f * (rnd32() % 1000) / 1000.0f);
                row[b + o] = (uint8_t)(h & 0xff), row[b + o + 1] = (uint8_t)(h >> 8);
            }
    }
    return q;
}
static const int all_types[] = {M40K_TYPE_F32,  M40K_TYPE_F16,  M40K_TYPE_BF16, M40K_TYPE_Q8_0,
                                M40K_TYPE_Q4_0, M40K_TYPE_Q4_1, M40K_TYPE_Q5_0, M40K_TYPE_Q5_1,
                                M40K_TYPE_Q2_K, M40K_TYPE_Q3_K, M40K_TYPE_Q4_K, M40K_TYPE_Q5_K, M40K_TYPE_Q6_K};

/* ---------------------------------------------------------------- 1. embed */
static void test_embed(void)
{
    for (int type : all_types) {
        const int be = m40_type_get((uint32_t)type)->block_elems;
        const int dim = be == 1 ? 4096 + 64 + 1 : be == 32 ? 32 * 37 : 256 * 5;
        const int n_rows = 41;
        std::vector<uint8_t> tab = quant_matrix(type, n_rows, dim);
        std::vector<int32_t> ids = {0, 40, 7, -1, 41, 3, 3, 17, 29, 1, 38};
        for (int out_type : {M40K_TYPE_F32, M40K_TYPE_F16}) {
            const int64_t os = dim + 3;
            size_t n = ids.size() * os;
            uint8_t *dt = dup(tab);
            int32_t *di = dup(ids);
            void *dout;
            CK(cudaMalloc(&dout, n * 4));
            CK(cudaMemset(dout, 0, n * 4));
            CK(m40k_embed(dt, type, n_rows, dim, di, (int)ids.size(), dout, out_type, os, 0));
            std::vector<float> g, c(n, 0.0f);
            char what[96];
            snprintf(what, sizeof what, "embed %s dim %d -> %s", m40_type_name(type), dim, out_type ? "f16" : "f32");
            if (out_type == M40K_TYPE_F16) {
                std::vector<uint16_t> ch(n, 0);
                m40_ref_embed(tab.data(), type, n_rows, dim, ids.data(), (int)ids.size(), ch.data(), out_type, os);
                g = h2f(back((uint16_t *)dout, n));
                c = h2f(ch);
            } else {
                m40_ref_embed(tab.data(), type, n_rows, dim, ids.data(), (int)ids.size(), c.data(), out_type, os);
                g = back((float *)dout, n);
            }
            compare(what, g.data(), c.data(), n, 1e-6f, out_type ? 1e-3f : 1e-6f);
            cudaFree(dt), cudaFree(di), cudaFree(dout);
        }
    }
}

/* The regrouped layouts (kernels.h 0.) gather the same rows as their GGUF types. */
static void test_embed_g8(void)
{
    for (int type : {M40K_TYPE_Q8_0, M40K_TYPE_Q6_K})
        for (int dim : {2048, 4096 + 2048}) {
            const int n_rows = 9, g8 = m40k_g8_type(type, dim);
            std::vector<uint8_t> tab = quant_matrix(type, n_rows, dim), tab8(tab.size());
            CK(m40k_repack_g8(type, tab.data(), tab8.data(), n_rows, dim));
            std::vector<int32_t> ids = {0, 8, 3, -1, 9, 5};
            const size_t n = ids.size() * dim;
            std::vector<float> c(n, 0.0f);
            m40_ref_embed(tab.data(), type, n_rows, dim, ids.data(), (int)ids.size(), c.data(), M40K_TYPE_F32, dim);
            uint8_t *dt = dup(tab8);
            int32_t *di = dup(ids);
            float *dout;
            CK(cudaMalloc(&dout, n * 4));
            CK(m40k_embed(dt, g8, n_rows, dim, di, (int)ids.size(), dout, M40K_TYPE_F32, dim, 0));
            std::vector<float> g = back(dout, n);
            char what[96];
            snprintf(what, sizeof what, "embed %s_G8 dim %d -> f32", m40_type_name(type), dim);
            compare(what, g.data(), c.data(), n, 1e-6f, 1e-6f);
            cudaFree(dt), cudaFree(di), cudaFree(dout);
        }
}

/* Whether h (rows x width, rows contiguous) is the F16 of f (rows at stride fs), bit for bit:
 * the F16 copies the norm and GLU kernels write beside (or instead of) their F32 output. */
static bool is_f16_of(const std::vector<uint16_t> &h, const std::vector<float> &f, int rows, int width, int64_t fs)
{
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < width; i++)
            if (h[(size_t)r * width + i] != m40_fp32_to_fp16(f[(size_t)r * fs + i]))
                return false;
    return true;
}

/* A paged cache's K and V (n elements each) of random F16 values in [-1, 1) */
static void rand_kv(size_t n, std::vector<uint16_t> &k, std::vector<uint16_t> &v)
{
    k.resize(n), v.resize(n);
    for (size_t i = 0; i < n; i++)
        k[i] = m40_fp32_to_fp16(frand(-1, 1)), v[i] = m40_fp32_to_fp16(frand(-1, 1));
}

/* ---------------------------------------------------------------- 2. rmsnorm */
static void test_rmsnorm(void)
{
    /* odd strides: the one-element kernel; strides of 4: the four-element one */
    for (int dim : {7, 64, 4096 + 64 + 1, 512, 4096})
        for (int rows : {1, 3, 17, 512})
            for (int out_type : {M40K_TYPE_F32, M40K_TYPE_F16}) {
                if (rows == 512 && dim != 4096)
                    continue;
                const bool v4 = dim == 512 || dim == 4096;
                const int64_t xs = dim + (v4 ? 4 : 5), os = dim + (v4 ? 8 : 2);
                std::vector<float> x = rand_vec(rows * xs, -3, 3), w = rand_vec(dim, 0.5f, 1.5f);
                float *dx = dup(x), *dw = dup(w);
                void *dout;
                CK(cudaMalloc(&dout, rows * os * 4));
                CK(cudaMemset(dout, 0, rows * os * 4));
                CK(m40k_rmsnorm(dx, xs, dw, dout, out_type, os, rows, dim, 1e-5f, 0));
                std::vector<float> g, c(rows * os, 0.0f);
                if (out_type == M40K_TYPE_F16) {
                    std::vector<uint16_t> ch(rows * os, 0);
                    m40_ref_rmsnorm(x.data(), xs, w.data(), ch.data(), out_type, os, rows, dim, 1e-5f);
                    c = h2f(ch);
                    g = h2f(back((uint16_t *)dout, rows * os));
                } else {
                    m40_ref_rmsnorm(x.data(), xs, w.data(), c.data(), out_type, os, rows, dim, 1e-5f);
                    g = back((float *)dout, rows * os);
                }
                char what[96];
                snprintf(what, sizeof what, "rmsnorm rows %d dim %d -> %s", rows, dim, out_type ? "f16" : "f32");
                compare(what, g.data(), c.data(), g.size(), 1e-5f, out_type ? 2e-3f : 1e-5f);
                cudaFree(dx), cudaFree(dw), cudaFree(dout);
            }
}

static void test_add_rmsnorm(void)
{
    /* in place: the single-block kernel at every width and row count (the 16-block one
     * needs x_out apart from x: test_add_rmsnorm_to) */
    for (int dim : {7, 64, 256, 512, 2048, 4096, 4096 + 64 + 1, 16384})
        for (int rows : {1, 3, 17})
            for (int alias : {0, 1}) { /* out == d, as the model uses it */
                const int64_t xs = dim + 5, ds = dim + 3, os = alias ? ds : dim + 2;
                std::vector<float> x = rand_vec(rows * xs, -3, 3), d = rand_vec(rows * ds, -3, 3),
                                   w = rand_vec(dim, 0.5f, 1.5f), c(rows * os, 0.0f);
                float *dx = dup(x), *dd = dup(d), *dw = dup(w), *dout = dd;
                if (!alias) {
                    CK(cudaMalloc(&dout, rows * os * 4));
                    CK(cudaMemset(dout, 0, rows * os * 4));
                }
                CK(m40k_add_rmsnorm(dx, xs, dd, ds, dw, dout, os, rows, dim, 1e-5f, 0));
                float *cout = alias ? d.data() : c.data();
                m40_ref_add_rmsnorm(x.data(), xs, d.data(), ds, w.data(), cout, os, rows, dim, 1e-5f);
                char what[96];
                snprintf(what, sizeof what, "add_rmsnorm rows %d dim %d%s", rows, dim, alias ? " out=d" : "");
                std::vector<float> gx = back(dx, x.size()), go = back(dout, rows * os);
                compare(what, gx.data(), x.data(), x.size(), 0.0f, 0.0f); /* x + d: exact */
                compare(what, go.data(), cout, go.size(), 1e-5f, 1e-5f);
                cudaFree(dx), cudaFree(dd), cudaFree(dw);
                if (!alias)
                    cudaFree(dout);
            }
}

/* ---------------------------------------------------------------- 3. rope */
static void test_rope(void)
{
    for (int hd : {64, 128, 256})
        for (int rot : {hd, 32})
            for (int neox : {0, 1})
                for (int ff : {0, 1})
                    for (int nt : {1, 3, 17})
                    for (int heads : {0, 1, 2}) { /* 8/2, 7/3 (partial head chunks), 5 Q heads and no K */
                        const int nq = heads == 0 ? 8 : heads == 1 ? 7 : 5, nk = heads == 0 ? 2 : heads == 1 ? 3 : 1;
                        const int64_t qs = nq * hd + 4, ks = nk * hd + 8;
                        std::vector<float> q = rand_vec(nt * qs), k = rand_vec(nt * ks), f = rand_vec(rot / 2, 1, 8);
                        std::vector<int32_t> pos(nt);
                        for (int t = 0; t < nt; t++)
                            pos[t] = t == 0 ? 0 : (int32_t)(rnd32() % 200000);
                        float *dq = dup(q), *dk = dup(k), *df = dup(f);
                        int32_t *dp = dup(pos);
                        CK(m40k_rope(dq, qs, nq, heads == 2 ? nullptr : dk, ks, nk, hd, rot, dp, nt, 500000.0f,
                                     ff ? df : nullptr, neox, 0));
                        m40_ref_rope(q.data(), qs, nq, heads == 2 ? nullptr : k.data(), ks, nk, hd, rot, pos.data(),
                                     nt, 500000.0f, ff ? f.data() : nullptr, neox);
                        char what[112];
                        snprintf(what, sizeof what, "rope hd %d rot %d neox %d ff %d tokens %d heads %d/%d", hd, rot,
                                 neox, ff, nt, nq, heads == 2 ? 0 : nk);
                        std::vector<float> gq = back(dq, q.size()), gk = back(dk, k.size());
                        compare(what, gq.data(), q.data(), q.size(), 1e-5f, 1e-5f);
                        compare(what, gk.data(), k.data(), k.size(), 1e-5f, 1e-5f);
                        cudaFree(dq), cudaFree(dk), cudaFree(df), cudaFree(dp);
                    }
}

/* ---------------------------------------------------------------- 4. glu, add */
static void test_act(void)
{
    for (int act : {M40K_GLU_SILU, M40K_GLU_GELU_TANH})
        for (int rows : {1, 3, 17}) {
            const int n = 4096 + 64 + 1;
            const int64_t is = 2 * n + 1, os = n + 3;
            std::vector<float> in = rand_vec(rows * is, -6, 6), c(rows * os, 0.0f);
            float *din = dup(in), *dout;
            CK(cudaMalloc(&dout, c.size() * 4));
            CK(cudaMemset(dout, 0, c.size() * 4));
            CK(m40k_glu(act, din, din + n, is, dout, os, rows, n, 0));
            m40_ref_glu(act, in.data(), in.data() + n, is, c.data(), os, rows, n);
            std::vector<float> g = back(dout, c.size());
            char what[64];
            snprintf(what, sizeof what, "glu act %d rows %d", act, rows);
            compare(what, g.data(), c.data(), c.size(), 1e-5f, 1e-5f);
            cudaFree(din), cudaFree(dout);
        }
    const int64_t n = 100003;
    std::vector<float> a = rand_vec(n), b = rand_vec(n), c(n);
    float *da = dup(a), *db = dup(b);
    CK(m40k_add(da, da, db, n, 0));
    m40_ref_add(c.data(), a.data(), b.data(), n);
    std::vector<float> g = back(da, n);
    compare("add in place", g.data(), c.data(), n, 0, 0);
    cudaFree(da), cudaFree(db);
}

/* 2c / 4b: add + RMSNorm and the gated activation that also quantize their output for
 * the int8 GEMV: the output as the plain kernels' twins, and the workspace byte for byte
 * what the twin quantizer (m40_ref_quantize_q8) makes of the GPU's output. */
static void test_fused_q8(void)
{
    for (int dim : {64, 256, 640, 2048, 4096, 4096 + 1024 + 32, 8192})
        for (int rows : {1, 3, 8, 17}) {
            const int64_t xs = dim + 5, ds = dim + 3;
            std::vector<float> x = rand_vec(rows * xs, -3, 3), d = rand_vec(rows * ds, -3, 3),
                               w = rand_vec(dim, 0.5f, 1.5f);
            float *dx = dup(x), *dd = dup(d), *dw = dup(w);
            void *dq;
            const size_t wsb = m40k_gemv_q8_ws_bytes(dim, rows);
            CK(cudaMalloc(&dq, wsb));
            CK(m40k_add_rmsnorm_q8(dx, xs, dd, ds, dw, dd, ds, rows, dim, 1e-5f, dq, 0));
            m40_ref_add_rmsnorm(x.data(), xs, d.data(), ds, w.data(), d.data(), ds, rows, dim, 1e-5f);
            std::vector<float> go = back(dd, d.size());
            char what[96];
            snprintf(what, sizeof what, "add_rmsnorm_q8 rows %d dim %d: out", rows, dim);
            compare(what, go.data(), d.data(), go.size(), 1e-5f, 1e-5f);
            std::vector<uint8_t> ws(wsb);
            m40_ref_quantize_q8(go.data(), ds, dim, rows, ws.data());
            snprintf(what, sizeof what, "add_rmsnorm_q8 rows %d dim %d: workspace", rows, dim);
            check(what, back((uint8_t *)dq, wsb) == ws);
            cudaFree(dx), cudaFree(dd), cudaFree(dw), cudaFree(dq);
        }
    for (int act : {M40K_GLU_SILU, M40K_GLU_GELU_TANH})
        for (int n : {32, 640, 14336 + 32})
            for (int rows : {1, 5, 8}) {
                const int64_t is = 2 * n + 1, os = n + 3;
                std::vector<float> in = rand_vec(rows * is, -6, 6), c(rows * os, 0.0f);
                float *din = dup(in), *dout;
                void *dq;
                const size_t wsb = m40k_gemv_q8_ws_bytes(n, rows);
                CK(cudaMalloc(&dq, wsb));
                CK(cudaMalloc(&dout, c.size() * 4));
                CK(cudaMemset(dout, 0, c.size() * 4));
                CK(m40k_glu_q8(act, din, din + n, is, dout, os, rows, n, dq, 0));
                m40_ref_glu(act, in.data(), in.data() + n, is, c.data(), os, rows, n);
                std::vector<float> g = back(dout, c.size());
                char what[96];
                snprintf(what, sizeof what, "glu_q8 act %d n %d rows %d: out", act, n, rows);
                compare(what, g.data(), c.data(), c.size(), 1e-5f, 1e-5f);
                std::vector<uint8_t> ws(wsb);
                m40_ref_quantize_q8(g.data(), os, n, rows, ws.data());
                snprintf(what, sizeof what, "glu_q8 act %d n %d rows %d: workspace", act, n, rows);
                check(what, back((uint8_t *)dq, wsb) == ws);
                cudaFree(din), cudaFree(dout), cudaFree(dq);
            }
    /* refused: a dim that is not a multiple of 32, a missing workspace */
    check("add_rmsnorm_q8 dim 7 refused", m40k_add_rmsnorm_q8(nullptr, 8, nullptr, 8, nullptr, nullptr, 8, 1, 7, 1e-5f,
                                                               (void *)16, 0) != 0);
    check("glu_q8 without workspace refused",
          m40k_glu_q8(M40K_GLU_SILU, nullptr, nullptr, 64, nullptr, 32, 1, 32, nullptr, 0) != 0);
}

/* 2d / 4c: the same two kernels writing an F16 copy of their output for the tensor-core
 * products: the output as the plain kernels' twins, the copy bit for bit the F16
 * rounding (m40_fp32_to_fp16) of the GPU's output, rows contiguous. Row counts past 8
 * (where the engine uses them) and odd widths. */
static void test_fused_f16(void)
{
    for (int dim : {64, 100, 4096, 4096 + 1024 + 32})
        for (int rows : {1, 9, 38}) {
            const int64_t xs = dim + 5, ds = dim + 3;
            std::vector<float> x = rand_vec(rows * xs, -3, 3), d = rand_vec(rows * ds, -3, 3),
                               w = rand_vec(dim, 0.5f, 1.5f);
            float *dx = dup(x), *dd = dup(d), *dw = dup(w);
            uint16_t *dh;
            CK(cudaMalloc(&dh, (size_t)rows * dim * 2));
            CK(m40k_add_rmsnorm_f16(dx, xs, dd, ds, dw, dd, ds, rows, dim, 1e-5f, dh, 0));
            m40_ref_add_rmsnorm(x.data(), xs, d.data(), ds, w.data(), d.data(), ds, rows, dim, 1e-5f);
            std::vector<float> go = back(dd, d.size());
            char what[96];
            snprintf(what, sizeof what, "add_rmsnorm_f16 rows %d dim %d: out", rows, dim);
            compare(what, go.data(), d.data(), go.size(), 1e-5f, 1e-5f);
            std::vector<uint16_t> h = back(dh, (size_t)rows * dim);
            const bool same = is_f16_of(h, go, rows, dim, ds);
            snprintf(what, sizeof what, "add_rmsnorm_f16 rows %d dim %d: F16 copy", rows, dim);
            check(what, same);
            cudaFree(dx), cudaFree(dd), cudaFree(dw), cudaFree(dh);
        }
    for (int act : {M40K_GLU_SILU, M40K_GLU_GELU_TANH})
        for (int n : {33, 640, 14336 + 32})
            for (int rows : {1, 9, 38}) {
                const int64_t is = 2 * n + 1, os = n + 3;
                std::vector<float> in = rand_vec(rows * is, -6, 6), c(rows * os, 0.0f);
                float *din = dup(in), *dout;
                uint16_t *dh;
                CK(cudaMalloc(&dh, (size_t)rows * n * 2));
                CK(cudaMalloc(&dout, c.size() * 4));
                CK(cudaMemset(dout, 0, c.size() * 4));
                CK(m40k_glu_f16(act, din, din + n, is, dout, os, rows, n, dh, 0));
                m40_ref_glu(act, in.data(), in.data() + n, is, c.data(), os, rows, n);
                std::vector<float> g = back(dout, c.size());
                char what[96];
                snprintf(what, sizeof what, "glu_f16 act %d n %d rows %d: out", act, n, rows);
                compare(what, g.data(), c.data(), c.size(), 1e-5f, 1e-5f);
                std::vector<uint16_t> h = back(dh, (size_t)rows * n);
                const bool same = is_f16_of(h, g, rows, n, os);
                snprintf(what, sizeof what, "glu_f16 act %d n %d rows %d: F16 copy", act, n, rows);
                check(what, same);
                cudaFree(din), cudaFree(dout), cudaFree(dh);
            }
    /* Rows at 16-byte strides past the decode kernel's 16 take the 16-byte-load kernels
     * (prefill chunks), 9 and 16 rows of 4096 the decode one, the rest the one-block
     * kernel; without out (NULL) each writes only the F16 copy, the same bits. 2f (any):
     * one kernel at every row count, each row the same bits (out, x_out, the F16 copy)
     * as that row alone. */
    for (int any : {0, 1})
        for (int dim : {64, 100, 256, 4096, 5152})
            for (int rows : {1, 3, 9, 16, 17, 38, 64, 512}) {
                const char *name = any ? "add_rmsnorm_to_any" : "add_rmsnorm_to 16-byte";
                const int64_t xs = dim, ds = dim + 4;
                std::vector<float> x = rand_vec(rows * xs, -3, 3), d = rand_vec(rows * ds, -3, 3),
                                   w = rand_vec(dim, 0.5f, 1.5f);
                float *dx = dup(x), *dd = dup(d), *dw = dup(w), *dxo, *dout = dup(d); /* gaps: d, as the twin's */
                CK(cudaMalloc(&dxo, x.size() * 4));
                uint16_t *dh, *dh2;
                CK(cudaMalloc(&dh, (size_t)rows * dim * 2));
                CK(cudaMalloc(&dh2, (size_t)rows * dim * 2));
                auto run = [&](int r0, int nr, float *xo, float *out, uint16_t *h) {
                    const float *xa = dx + r0 * xs, *da = dd + r0 * ds;
                    float *xoa = xo + r0 * xs, *oa = out ? out + r0 * ds : nullptr;
                    uint16_t *ha = h + (size_t)r0 * dim;
                    return any ? m40k_add_rmsnorm_to_any(xa, xs, da, ds, xoa, dw, oa, ds, nr, dim, 1e-5f, ha, 0)
                               : m40k_add_rmsnorm_to(xa, xs, da, ds, xoa, dw, oa, ds, nr, dim, 1e-5f, nullptr, ha, 0);
                };
                CK(run(0, rows, dxo, dout, dh));
                CK(run(0, rows, dxo, nullptr, dh2));
                std::vector<float> c = d, xr = x;
                m40_ref_add_rmsnorm(xr.data(), xs, d.data(), ds, w.data(), c.data(), ds, rows, dim, 1e-5f);
                std::vector<float> go = back(dout, c.size()), gx = back(dxo, x.size());
                char what[112];
                snprintf(what, sizeof what, "%s rows %d dim %d: out", name, rows, dim);
                compare(what, go.data(), c.data(), go.size(), 1e-5f, 1e-5f);
                snprintf(what, sizeof what, "%s rows %d dim %d: x_out", name, rows, dim);
                check(what, gx == xr);
                std::vector<uint16_t> h = back(dh, (size_t)rows * dim), h2 = back(dh2, (size_t)rows * dim);
                snprintf(what, sizeof what, "%s rows %d dim %d: F16 copy", name, rows, dim);
                check(what, is_f16_of(h, go, rows, dim, ds));
                snprintf(what, sizeof what, "%s rows %d dim %d: without out, the same copy", name, rows, dim);
                check(what, h == h2);
                if (any) { /* each row alone, into fresh buffers */
                    float *dxo1 = dup(std::vector<float>(x.size(), 0.0f));
                    float *dout1 = dup(std::vector<float>(d.size(), 0.0f));
                    for (int r = 0; r < rows; r++)
                        CK(run(r, 1, dxo1, dout1, dh2));
                    std::vector<float> go1 = back(dout1, c.size());
                    bool alone = back(dh2, (size_t)rows * dim) == h && back(dxo1, x.size()) == gx;
                    for (int r = 0; r < rows; r++)
                        alone = alone && !memcmp(go.data() + r * ds, go1.data() + r * ds, (size_t)dim * 4);
                    snprintf(what, sizeof what, "%s rows %d dim %d: each row as alone, bit for bit", name, rows, dim);
                    check(what, alone);
                    cudaFree(dxo1), cudaFree(dout1);
                }
                cudaFree(dx), cudaFree(dd), cudaFree(dw), cudaFree(dxo), cudaFree(dout), cudaFree(dh), cudaFree(dh2);
            }
    for (int act : {M40K_GLU_SILU, M40K_GLU_GELU_TANH})
        for (int n : {36, 640, 14336})
            for (int rows : {1, 38, 512}) {
                const int64_t is = 2 * n, os = n + 4;
                std::vector<float> in = rand_vec(rows * is, -6, 6), c(rows * os, 0.0f);
                float *din = dup(in), *dout;
                uint16_t *dh, *dh2;
                CK(cudaMalloc(&dh, (size_t)rows * n * 2));
                CK(cudaMalloc(&dh2, (size_t)rows * n * 2));
                CK(cudaMalloc(&dout, c.size() * 4));
                CK(cudaMemset(dout, 0, c.size() * 4));
                CK(m40k_glu_f16(act, din, din + n, is, dout, os, rows, n, dh, 0));
                CK(m40k_glu_f16(act, din, din + n, is, nullptr, os, rows, n, dh2, 0));
                m40_ref_glu(act, in.data(), in.data() + n, is, c.data(), os, rows, n);
                std::vector<float> g = back(dout, c.size());
                char what[112];
                snprintf(what, sizeof what, "glu_f16 16-byte act %d n %d rows %d: out", act, n, rows);
                compare(what, g.data(), c.data(), c.size(), 1e-5f, 1e-5f);
                std::vector<uint16_t> h = back(dh, (size_t)rows * n), h2 = back(dh2, (size_t)rows * n);
                const bool same = is_f16_of(h, g, rows, n, os);
                snprintf(what, sizeof what, "glu_f16 16-byte act %d n %d rows %d: F16 copy", act, n, rows);
                check(what, same);
                snprintf(what, sizeof what, "glu_f16 16-byte act %d n %d rows %d: without out, the same copy", act, n,
                         rows);
                check(what, h == h2);
                cudaFree(din), cudaFree(dout), cudaFree(dh), cudaFree(dh2);
            }
    /* 4d. F16 gate/up at a scale: the twin on the same F32 inputs, rounded to F16, within
     * one F16 step (the GPU's expf and tanhf against the C library's); rows of odd
     * length and stride take the one-element path, 644 the four-element one, the others
     * the eight-element one */
    for (int act : {M40K_GLU_SILU, M40K_GLU_GELU_TANH})
        for (int n : {37, 644, 640, 14336})
            for (int rows : {1, 38, 512}) {
                const int64_t is = 2 * n + (n & 1);
                const float scale = 16.0f;
                std::vector<float> in = rand_vec(rows * is, -6.0f / 16, 6.0f / 16);
                std::vector<uint16_t> in16(in.size());
                std::vector<float> inf(in.size());
                for (size_t i = 0; i < in.size(); i++) {
                    in16[i] = m40_fp32_to_fp16(in[i]);
                    inf[i] = scale * m40_fp16_to_fp32(in16[i]);
                }
                std::vector<float> c((size_t)rows * n, 0.0f);
                m40_ref_glu(act, inf.data(), inf.data() + n, is, c.data(), n, rows, n);
                uint16_t *din = dup(in16), *dh;
                CK(cudaMalloc(&dh, (size_t)rows * n * 2));
                CK(m40k_glu_h16(act, din, din + n, is, scale, dh, rows, n, 0));
                std::vector<uint16_t> h = back(dh, (size_t)rows * n);
                size_t far = 0;
                for (size_t i = 0; i < h.size(); i++) {
                    const float ref = m40_fp16_to_fp32(m40_fp32_to_fp16(c[i])), got = m40_fp16_to_fp32(h[i]);
                    far += !(fabsf(got - ref) <= fabsf(ref) / 1024.0f + 1e-7f);
                }
                char what[112];
                snprintf(what, sizeof what, "glu_h16 act %d n %d rows %d: %zu outside an F16 step", act, n, rows, far);
                check(what, far == 0);
                cudaFree(din), cudaFree(dh);
            }
    check("glu_h16 without out16 refused",
          m40k_glu_h16(M40K_GLU_SILU, (const uint16_t *)16, (const uint16_t *)16, 64, 1.0f, nullptr, 1, 32, 0) != 0);
    check("add_rmsnorm_to with neither out, xq nor out16 refused",
          m40k_add_rmsnorm_to((const float *)16, 8, (const float *)16, 8, (float *)16, (const float *)16, nullptr, 8, 1,
                              8, 1e-5f, nullptr, nullptr, 0) != 0);
    check("glu with neither out nor a copy refused",
          m40k_glu(M40K_GLU_SILU, (const float *)16, (const float *)16, 64, nullptr, 32, 1, 32, 0) != 0);
    check("add_rmsnorm_f16 without out16 refused", m40k_add_rmsnorm_f16(nullptr, 8, nullptr, 8, nullptr, nullptr, 8,
                                                                         1, 8, 1e-5f, nullptr, 0) != 0);
    check("glu_f16 without out16 refused",
          m40k_glu_f16(M40K_GLU_SILU, nullptr, nullptr, 64, nullptr, 32, 1, 32, nullptr, 0) != 0);
}

/* 2e. m40k_add_rmsnorm_to, the residual stream out of place (how decode steps call it):
 * x left as it was, x_out exactly x + d, out as the twin's, and where asked the int8
 * workspace (byte for byte the twin quantizer's of the GPU's out) and the F16 copy (bit
 * for bit its rounding). Widths that are multiples of 512 up to 8,192 at up to 16 rows
 * of 16-byte strides take the kernel whose blocks each sum the whole row; 17 rows, other
 * widths and strides the others; the same call in place (x_out = x, out = d) as well. */
static void test_add_rmsnorm_to(void)
{
    for (int dim : {64, 512, 4096, 4096 + 64, 4096 + 64 + 1, 16384})
        for (int rows : {1, 3, 16, 17})
            for (int mode : {0, 1, 2, 3}) { /* 0 plain, 1 int8, 2 F16 copy, 3 in place (int8 where it can) */
                const bool q8 = (mode == 1 || mode == 3) && dim % 32 == 0, f16 = mode == 2;
                /* odd row counts: 16-byte rows (what the one-round kernel needs), even: not */
                const int64_t xs = rows & 1 ? dim + 4 : dim + 5, ds = rows & 1 ? dim + 8 : dim + 3,
                              os = mode == 3 ? ds : dim + 2;
                std::vector<float> x = rand_vec(rows * xs, -3, 3), d = rand_vec(rows * ds, -3, 3),
                                   w = rand_vec(dim, 0.5f, 1.5f);
                float *dx = dup(x), *dd = dup(d), *dw = dup(w), *dxo = dx, *dout = dd;
                if (mode != 3) {
                    CK(cudaMalloc(&dxo, rows * xs * 4));
                    CK(cudaMalloc(&dout, rows * os * 4));
                }
                void *dq = nullptr;
                uint16_t *dh = nullptr;
                const size_t wsb = q8 ? m40k_gemv_q8_ws_bytes(dim, rows) : 0;
                if (q8)
                    CK(cudaMalloc(&dq, wsb));
                if (f16)
                    CK(cudaMalloc(&dh, (size_t)rows * dim * 2));
                CK(m40k_add_rmsnorm_to(dx, xs, dd, ds, dxo, dw, dout, os, rows, dim, 1e-5f, dq, dh, 0));
                std::vector<float> xr = x, c(rows * os, 0.0f);
                m40_ref_add_rmsnorm(xr.data(), xs, d.data(), ds, w.data(), c.data(), os, rows, dim, 1e-5f);
                char what[112];
                snprintf(what, sizeof what, "add_rmsnorm_to rows %d dim %d mode %d", rows, dim, mode);
                std::vector<float> gxo = back(dxo, x.size()), go = back(dout, rows * os);
                bool exact = true, kept = true;
                for (int r = 0; r < rows; r++)
                    for (int i = 0; i < dim; i++)
                        exact = exact && gxo[(size_t)r * xs + i] == xr[(size_t)r * xs + i];
                if (mode != 3) {
                    std::vector<float> gx = back(dx, x.size());
                    kept = gx == x;
                }
                check((std::string(what) + ": x_out = x + d exactly").c_str(), exact);
                check((std::string(what) + ": x as it was").c_str(), kept);
                std::vector<float> go_rows, c_rows;
                for (int r = 0; r < rows; r++)
                    for (int i = 0; i < dim; i++)
                        go_rows.push_back(go[(size_t)r * os + i]), c_rows.push_back(c[(size_t)r * os + i]);
                compare(what, go_rows.data(), c_rows.data(), go_rows.size(), 1e-5f, 1e-5f);
                if (q8) {
                    std::vector<uint8_t> ws(wsb);
                    m40_ref_quantize_q8(go.data(), os, dim, rows, ws.data());
                    check((std::string(what) + ": workspace").c_str(), back((uint8_t *)dq, wsb) == ws);
                }
                if (f16) {
                    std::vector<uint16_t> h = back(dh, (size_t)rows * dim);
                    const bool same = is_f16_of(h, go, rows, dim, os);
                    check((std::string(what) + ": F16 copy").c_str(), same);
                }
                cudaFree(dx), cudaFree(dd), cudaFree(dw), cudaFree(dq), cudaFree(dh);
                if (mode != 3)
                    cudaFree(dxo), cudaFree(dout);
            }
    check("add_rmsnorm_to int8 of dim 7 refused",
          m40k_add_rmsnorm_to(nullptr, 8, nullptr, 8, nullptr, nullptr, nullptr, 8, 1, 7, 1e-5f, (void *)16, nullptr,
                              0) != 0);
}

/* ---------------------------------------------------------------- paged cache fixture */
#include "paged_fixture.h"

/* ---------------------------------------------------------------- 5-7. kv append, attention */
static void test_attention(void)
{
    for (int hd : {64, 128, 256})
        for (int G : {1, 4, 8, 7}) {
            if (G == 7 && hd != 64)
                continue;
            const int nkv = 2, nh = nkv * G;
            const float scale = 1.0f / sqrtf((float)hd);
            /* sequences: total lengths and how many of their last tokens are new */
            std::vector<int> lens = {1, 15, 16, 17, 100, 1000}, news = {1, 15, 3, 17, 100, 37};
            Paged p = make_paged(lens);
            const size_t cache_elems = (size_t)p.n_blocks * nkv * M40K_PAGE * hd;
            std::vector<uint16_t> kc(cache_elems), vc(cache_elems);
            for (size_t i = 0; i < cache_elems; i++)
                kc[i] = m40_fp32_to_fp16(frand(-1, 1)), vc[i] = m40_fp32_to_fp16(frand(-1, 1));
            std::vector<int32_t> new_indptr = {0};
            for (int n : news)
                new_indptr.push_back(new_indptr.back() + n);
            const int nt = new_indptr.back();
            const int64_t ks = nkv * hd + 4;
            std::vector<float> k = rand_vec(nt * ks, -2, 2), v = rand_vec(nt * ks, -2, 2);

            uint16_t *dkc = dup(kc), *dvc = dup(vc);
            int32_t *dip = dup(p.indptr), *dix = dup(p.indices), *dlp = dup(p.lpl), *dni = dup(new_indptr);
            float *dk = dup(k), *dv = dup(v);
            CK(m40k_kv_append(dkc, dvc, dk, ks, dv, ks, dni, p.n_seqs, nt, dip, dix, dlp, nkv, hd, 0));
            m40_ref_kv_append(kc.data(), vc.data(), k.data(), ks, v.data(), ks, new_indptr.data(), p.n_seqs, nt,
                              p.indptr.data(), p.indices.data(), p.lpl.data(), nkv, hd);
            char what[128];
            snprintf(what, sizeof what, "kv_append hd %d nkv %d tokens %d", hd, nkv, nt);
            check(what, back(dkc, cache_elems) == kc && back(dvc, cache_elems) == vc);

            /* decode: one query per sequence, with and without splits */
            const int64_t qs = nh * hd + 4, os = nh * hd + 8;
            std::vector<float> q = rand_vec(p.n_seqs * qs, -2, 2), c(p.n_seqs * os, 0.0f);
            m40_ref_attn_decode(c.data(), os, q.data(), qs, kc.data(), vc.data(), p.indptr.data(), p.indices.data(),
                                p.lpl.data(), p.n_seqs, nh, nkv, hd, scale);
            float *dq = dup(q), *dout, *dws;
            /* the split counters: zeroed once, shared by every call below (each call must
             * leave them zero); 64 splits leave most of the short sequences' splits empty */
            const size_t n_cnt = m40k_decode_counter_ints(p.n_seqs, nkv);
            int *dcnt = dup(std::vector<int>(n_cnt, 0));
            CK(cudaMalloc(&dout, c.size() * 4));
            /* on sm_90, 2..32 splits merge in a thread block cluster (up to 16 blocks: 32
             * splits run as 16), 64 through the workspace and counters */
            for (int splits : {1, 3, 8, 16, 32, 64}) {
                CK(cudaMalloc(&dws, std::max<size_t>(1, m40k_decode_workspace_floats(p.n_seqs, nh, hd, splits)) * 4));
                for (int rep = 0; rep < 2; rep++) { /* twice in a row: the counters were reset */
                    CK(cudaMemset(dout, 0, c.size() * 4));
                    CK(m40k_attn_decode(dout, os, dq, qs, dkc, dvc, dip, dix, dlp, p.n_seqs, nh, nkv, hd, scale,
                                        splits, splits > 1 ? dws : nullptr, splits > 1 ? dcnt : nullptr, 0));
                    std::vector<float> g = back(dout, c.size());
                    snprintf(what, sizeof what, "attn_decode hd %d G %d splits %d ctx 1..1000 call %d", hd, G, splits,
                             rep + 1);
                    compare(what, g.data(), c.data(), c.size(), 2e-4f, 1e-3f);
                }
                std::vector<int> cnt = back(dcnt, n_cnt);
                snprintf(what, sizeof what, "attn_decode hd %d G %d splits %d: counters left zero", hd, G, splits);
                check(what, std::all_of(cnt.begin(), cnt.end(), [](int v) { return v == 0; }));
                if (splits > 1) { /* splits need both the workspace and the counters */
                    snprintf(what, sizeof what, "attn_decode hd %d G %d splits %d: no counters refused", hd, G, splits);
                    const int rc = m40k_attn_decode(dout, os, dq, qs, dkc, dvc, dip, dix, dlp, p.n_seqs, nh, nkv, hd,
                                                    scale, splits, dws, nullptr, 0);
                    check(what, rc == (int)cudaErrorInvalidValue);
                }
                cudaFree(dws);
            }
            cudaFree(dq), cudaFree(dout), cudaFree(dcnt);

            /* prefill: the new tokens of every sequence as queries */
            std::vector<float> pq = rand_vec(nt * qs, -2, 2), pc(nt * os, 0.0f);
            m40_ref_attn_prefill(pc.data(), os, pq.data(), qs, new_indptr.data(), p.n_seqs, nt, kc.data(), vc.data(),
                                 p.indptr.data(), p.indices.data(), p.lpl.data(), nh, nkv, hd, scale);
            float *dpq = dup(pq), *dpo;
            CK(cudaMalloc(&dpo, pc.size() * 4));
            CK(cudaMemset(dpo, 0, pc.size() * 4));
            CK(m40k_attn_prefill(dpo, os, dpq, qs, dni, p.n_seqs, nt, dkc, dvc, dip, dix, dlp, nh, nkv, hd, scale, 0));
            std::vector<float> g = back(dpo, pc.size());
            snprintf(what, sizeof what, "attn_prefill hd %d G %d rows %d", hd, G, nt);
            compare(what, g.data(), pc.data(), pc.size(), 2e-4f, 1e-3f);
            cudaFree(dpq), cudaFree(dpo);
            cudaFree(dkc), cudaFree(dvc), cudaFree(dip), cudaFree(dix), cudaFree(dlp), cudaFree(dni), cudaFree(dk),
                cudaFree(dv);
        }
}

/* ---------------------------------------------------------------- 6c. decode attention + RoPE + append */
/* The RoPE decode attention's block a query head (the cluster variant at small batches,
 * attn_decode.cu dec_head_split) against the block a KV head (m40k_set_launch_tuning's
 * head_split 0) on the same inputs, and both against the CPU: one and two sequences
 * (577 positions; 40 and 1000), 1, 2 and 4 KV heads of groups of 2, 4 and 8 (qwen3-30b-a3b:
 * 4 of 8), head dims 64, 128 and 256, 8 and 32 splits, with and without a 20-token window,
 * sinks and the int8 records of out (byte for byte m40k_quantize_q8's where written); and
 * with the per-head Q/K norms in the kernel (6e), either split, against the CPU. */
static void test_attn_head_split(void)
{
    int n_cases = 0;
    for (const std::vector<int> &lens : {std::vector<int>{577}, std::vector<int>{40, 1000}})
        for (int hd : {64, 128, 256})
            for (int nkv : {1, 2, 4})
                for (int G : {2, 4, 8}) {
                    const int nh = nkv * G, ns = (int)lens.size();
                    const float scale = 1.0f / sqrtf((float)hd), base = 10000.0f;
                    Paged p = make_paged(lens);
                    const size_t cache_elems = (size_t)p.n_blocks * nkv * M40K_PAGE * hd;
                    std::vector<uint16_t> kc0, vc0;
                    rand_kv(cache_elems, kc0, vc0);
                    std::vector<int32_t> one = {0}, pos;
                    for (int s = 0; s < ns; s++)
                        one.push_back(s + 1), pos.push_back(p.lens[s] - 1);
                    const int64_t rs = (int64_t)(nh + 2 * nkv) * hd + 4, os = nh * hd + 8;
                    std::vector<float> qkv = rand_vec(ns * rs, -2, 2), sk = rand_vec(nh, -1, 3);
                    std::vector<float> wq = rand_vec(hd, 0.25, 2), wk = rand_vec(hd, 0.25, 2);
                    int32_t *dip = dup(p.indptr), *dix = dup(p.indices), *dlp = dup(p.lpl), *dp = dup(pos);
                    float *dqkv = dup(qkv), *dsk = dup(sk), *dwq = dup(wq), *dwk = dup(wk), *dws;
                    const size_t n_cnt = m40k_decode_counter_ints(ns, nkv);
                    int *dcnt = dup(std::vector<int>(n_cnt, 0));
                    CK(cudaMalloc(&dws, m40k_decode_workspace_floats(ns, nh, hd, 64) * 4));
                    const size_t xq_bytes = m40k_gemv_q8_ws_bytes(nh * hd, ns);
                    for (int splits : {8, 32})
                        for (int window : {0, 20})
                            for (int sinks : {0, 1}) {
                                std::vector<float> out[2];
                                std::vector<uint16_t> kc[2], vc[2];
                                std::vector<uint8_t> xq[2];
                                for (int hs = 0; hs < 2; hs++) {
                                    m40k_set_launch_tuning(1, 1, hs);
                                    /* where records are written depends on the split */
                                    const bool q8 = m40k_attn_decode_q8_ok(ns, nh, nkv, hd, splits) == 1;
                                    uint16_t *dkc = dup(kc0), *dvc = dup(vc0);
                                    float *dout = dup(std::vector<float>((size_t)ns * os, 0.0f));
                                    uint8_t *dxq = q8 ? dup(std::vector<uint8_t>(xq_bytes, 0xa5)) : nullptr;
                                    CK(m40k_attn_decode_rope(
                                        dout, os, dqkv, rs, dqkv + nh * hd, rs, dqkv + (nh + nkv) * hd, rs, dkc, dvc,
                                        dip, dix, dlp, ns, nh, nkv, hd, scale, window, 0.0f, dp, hd, base, nullptr, 0,
                                        splits, dws, dcnt, dec_opts_q8(dxq, sinks ? dsk : nullptr), 0));
                                    out[hs] = back(dout, (size_t)ns * os);
                                    kc[hs] = back(dkc, cache_elems), vc[hs] = back(dvc, cache_elems);
                                    if (q8) {
                                        xq[hs] = back(dxq, xq_bytes);
                                        uint8_t *dxq2 = dup(std::vector<uint8_t>(xq_bytes, 0));
                                        CK(m40k_quantize_q8(dout, os, nh * hd, ns, dxq2, 0));
                                        char w[160];
                                        snprintf(w, sizeof w, "head split %d hd %d nkv %d G %d seqs %d splits %d: records == quantize_q8 of out",
                                                 hs, hd, nkv, G, ns, splits);
                                        check(w, xq[hs] == back(dxq2, xq_bytes));
                                        cudaFree(dxq), cudaFree(dxq2);
                                    }
                                    cudaFree(dkc), cudaFree(dvc), cudaFree(dout);
                                }
                                m40k_set_launch_tuning(1, 1, 1);
                                char what[160], w2[224];
                                snprintf(what, sizeof what, "head split hd %d nkv %d G %d seqs %d splits %d window %d sinks %d",
                                         hd, nkv, G, ns, splits, window, sinks);
                                snprintf(w2, sizeof w2, "%s: out on == off", what);
                                compare(w2, out[1].data(), out[0].data(), out[0].size(), 1e-5f, 1e-5f);
                                snprintf(w2, sizeof w2, "%s: caches on == off", what);
                                check(w2, kc[1] == kc[0] && vc[1] == vc[0]);
                                snprintf(w2, sizeof w2, "%s: counters zero", what);
                                std::vector<int> cnt = back(dcnt, n_cnt);
                                check(w2, std::all_of(cnt.begin(), cnt.end(), [](int v) { return v == 0; }));
                                if (!sinks) { /* the CPU twin */
                                    std::vector<float> cq = qkv;
                                    std::vector<uint16_t> ck = kc0, cv = vc0;
                                    m40_ref_rope(cq.data(), rs, nh, cq.data() + nh * hd, rs, nkv, hd, hd, pos.data(), ns,
                                                 base, nullptr, 0);
                                    m40_ref_kv_append(ck.data(), cv.data(), cq.data() + nh * hd, rs,
                                                      cq.data() + (nh + nkv) * hd, rs, one.data(), ns, ns,
                                                      p.indptr.data(), p.indices.data(), p.lpl.data(), nkv, hd);
                                    std::vector<float> c((size_t)ns * os, 0.0f);
                                    m40_ref_attn_decode_window(c.data(), os, cq.data(), rs, ck.data(), cv.data(),
                                                               p.indptr.data(), p.indices.data(), p.lpl.data(), ns, nh,
                                                               nkv, hd, scale, window, 0.0f);
                                    for (int s = 0; s < ns; s++)
                                        for (int64_t j = (int64_t)nh * hd; j < os; j++)
                                            c[(size_t)s * os + j] = out[1][(size_t)s * os + j];
                                    snprintf(w2, sizeof w2, "%s: on vs cpu", what);
                                    compare(w2, out[1].data(), c.data(), c.size(), 2e-4f, 1e-3f);
                                    snprintf(w2, sizeof w2, "%s: v cache == cpu", what);
                                    check(w2, vc[1] == cv);
                                    /* with the Q/K norms in the kernel (6e), either split */
                                    std::vector<float> nq = qkv, nc((size_t)ns * os, 0.0f);
                                    std::vector<uint16_t> nk = kc0, nv = vc0;
                                    m40_ref_rmsnorm_heads(nq.data(), rs, nh, hd, wq.data(), ns, 1e-6f);
                                    m40_ref_rmsnorm_heads(nq.data() + nh * hd, rs, nkv, hd, wk.data(), ns, 1e-6f);
                                    m40_ref_rope(nq.data(), rs, nh, nq.data() + nh * hd, rs, nkv, hd, hd, pos.data(), ns,
                                                 base, nullptr, 0);
                                    m40_ref_kv_append(nk.data(), nv.data(), nq.data() + nh * hd, rs,
                                                      nq.data() + (nh + nkv) * hd, rs, one.data(), ns, ns,
                                                      p.indptr.data(), p.indices.data(), p.lpl.data(), nkv, hd);
                                    m40_ref_attn_decode_window(nc.data(), os, nq.data(), rs, nk.data(), nv.data(),
                                                               p.indptr.data(), p.indices.data(), p.lpl.data(), ns, nh,
                                                               nkv, hd, scale, window, 0.0f);
                                    for (int hs = 0; hs < 2; hs++) {
                                        m40k_set_launch_tuning(1, 1, hs);
                                        uint16_t *dkc = dup(kc0), *dvc = dup(vc0);
                                        float *dout = dup(std::vector<float>((size_t)ns * os, 0.0f));
                                        m40k_dec_opts o = {};
                                        o.q_norm = dwq, o.k_norm = dwk, o.norm_eps = 1e-6f;
                                        CK(m40k_attn_decode_rope(dout, os, dqkv, rs, dqkv + nh * hd, rs,
                                                                 dqkv + (nh + nkv) * hd, rs, dkc, dvc, dip, dix, dlp,
                                                                 ns, nh, nkv, hd, scale, window, 0.0f, dp, hd, base,
                                                                 nullptr, 0, splits, dws, dcnt, &o, 0));
                                        std::vector<float> g = back(dout, (size_t)ns * os);
                                        for (int s = 0; s < ns; s++)
                                            for (int64_t j = (int64_t)nh * hd; j < os; j++)
                                                g[(size_t)s * os + j] = 0.0f;
                                        snprintf(w2, sizeof w2, "%s head split %d: Q/K norms in the kernel vs cpu",
                                                 what, hs);
                                        compare(w2, g.data(), nc.data(), nc.size(), 2e-4f, 1e-3f);
                                        snprintf(w2, sizeof w2, "%s head split %d: Q/K norms: v cache == cpu", what,
                                                 hs);
                                        check(w2, back(dvc, cache_elems) == nv);
                                        cudaFree(dkc), cudaFree(dvc), cudaFree(dout);
                                    }
                                    m40k_set_launch_tuning(1, 1, 1);
                                }
                                n_cases++;
                            }
                    cudaFree(dip), cudaFree(dix), cudaFree(dlp), cudaFree(dp), cudaFree(dqkv), cudaFree(dsk),
                        cudaFree(dwq), cudaFree(dwk), cudaFree(dws), cudaFree(dcnt);
                }
    check("head split: cases ran", n_cases == 2 * 3 * 3 * 3 * 8);
}

/* m40k_attn_decode_rope against (a) the two-kernel path it replaces, m40k_kv_append_rope
 * (one new token a sequence) then m40k_attn_decode_window on the rotated q: the same bits
 * in both caches, out within 1e-5 (the same terms, the new token's in a tile of its own); (b) the CPU twins m40_ref_rope + m40_ref_kv_append +
 * m40_ref_attn_decode_window within the attention test's tolerance; (c) q, k and v left
 * as they were; (d) the split counters back at zero; (e) where the cluster merge can
 * (m40k_attn_decode_q8_ok), the option out_q8 gives the same out and int8 records
 * byte for byte m40k_quantize_q8's of it; (f) at 1 and 8 splits, with the per-head Q/K
 * norms, the q/k/v biases or both in the kernel (6e) against the CPU twins with the biases
 * and m40_ref_rmsnorm_heads first, the norms alone also against m40k_rmsnorm_qk then (a)'s
 * call; (g) with out also written as F16 (6e's out16): the same F32 out, out16 its F16 bit
 * for bit, nothing past the rows. Head sizes 64/128/256, groups of
 * 1, 4, 8 (7 at 64), RoPE over the whole head, over 24 dims (neox pairs straddling a
 * unit of 8) and none, normal and neox
 * pairs (neox with frequency factors), 1, 8, 16 and 64 splits (most empty for the short
 * sequences), with and without a 20-token window, with and without a soft-cap of the
 * scores (0.7: they reach about +-2 here, so it bends them); lengths 1..1000 across page ends,
 * positions the cache's for even sequences and large random ones for odd. */
/* 6e's plain option: each sequence's output (and what it appends to the cache) the same
 * bits in a launch of one sequence as in a launch of all of them, at 1 and 16 splits,
 * where the default takes a cluster for few sequences */
static void test_attn_decode_plain(void)
{
    const std::vector<int> lens = {1, 17, 100, 1000, 33};
    for (int hd : {64, 128})
        for (int G : {1, 4})
            for (int splits : {1, 16}) {
                const int nkv = 2, nh = nkv * G;
                Paged p = make_paged(lens);
                const int ns = p.n_seqs;
                const size_t cache_elems = (size_t)p.n_blocks * nkv * M40K_PAGE * hd;
                std::vector<uint16_t> kc0, vc0;
                rand_kv(cache_elems, kc0, vc0);
                std::vector<int32_t> pos;
                for (int s = 0; s < ns; s++)
                    pos.push_back(p.lens[s] - 1);
                const int64_t rs = (int64_t)(nh + 2 * nkv) * hd, os = nh * hd;
                std::vector<float> qkv = rand_vec(ns * rs, -2, 2);
                int32_t *dip = dup(p.indptr), *dix = dup(p.indices), *dlp = dup(p.lpl), *dp = dup(pos);
                float *dqkv = dup(qkv), *dout, *dout1, *dws;
                int *dcnt = dup(std::vector<int>(m40k_decode_counter_ints(ns, nkv), 0));
                CK(cudaMalloc(&dout, (size_t)ns * os * 4));
                CK(cudaMalloc(&dout1, (size_t)ns * os * 4));
                CK(cudaMalloc(&dws, m40k_decode_workspace_floats(ns, nh, hd, splits) * 4));
                uint16_t *dkc = dup(kc0), *dvc = dup(vc0), *dkc1 = dup(kc0), *dvc1 = dup(vc0);
                m40k_dec_opts o = {};
                o.plain = 1;
                CK(m40k_attn_decode_rope(dout, os, dqkv, rs, dqkv + nh * hd, rs, dqkv + (nh + nkv) * hd, rs, dkc, dvc,
                                         dip, dix, dlp, ns, nh, nkv, hd, 1.0f / sqrtf((float)hd), 0, 0.0f, dp, hd,
                                         10000.0f, nullptr, 0, splits, dws, dcnt, &o, 0));
                for (int s = 0; s < ns; s++) { /* each alone: its table entries, row and position */
                    const float *q = dqkv + (size_t)s * rs;
                    CK(m40k_attn_decode_rope(dout1 + (size_t)s * os, os, q, rs, q + nh * hd, rs, q + (nh + nkv) * hd,
                                             rs, dkc1, dvc1, dip + s, dix, dlp + s, 1, nh, nkv, hd,
                                             1.0f / sqrtf((float)hd), 0, 0.0f, dp + s, hd, 10000.0f, nullptr, 0,
                                             splits, dws, dcnt, &o, 0));
                }
                std::vector<float> g = back(dout, (size_t)ns * os), g1 = back(dout1, (size_t)ns * os);
                char what[112];
                snprintf(what, sizeof what,
                         "attn_decode_rope plain hd %d G %d splits %d: alone == batched, bit for bit", hd, G, splits);
                check(what, g == g1 && back(dkc, cache_elems) == back(dkc1, cache_elems) &&
                                back(dvc, cache_elems) == back(dvc1, cache_elems));
                cudaFree(dip), cudaFree(dix), cudaFree(dlp), cudaFree(dp), cudaFree(dqkv), cudaFree(dout);
                cudaFree(dout1), cudaFree(dws), cudaFree(dcnt), cudaFree(dkc), cudaFree(dvc), cudaFree(dkc1),
                    cudaFree(dvc1);
            }
}

static void test_attn_decode_rope(void)
{
    const std::vector<int> lens = {1, 15, 16, 17, 100, 1000};
    int n_q8 = 0; /* cases that also wrote int8 records (the option out_q8) */
    int n_qkn = 0; /* cases with Q/K norms or q/k/v biases (6e's options) */
    for (int hd : {64, 128, 256})
        for (int G : {1, 4, 8, 7}) {
            if (G == 7 && hd != 64)
                continue;
            const int nkv = 2, nh = nkv * G;
            const float scale = 1.0f / sqrtf((float)hd), base = 10000.0f;
            Paged p = make_paged(lens);
            const int ns = p.n_seqs;
            const size_t cache_elems = (size_t)p.n_blocks * nkv * M40K_PAGE * hd;
            std::vector<uint16_t> kc0, vc0;
            rand_kv(cache_elems, kc0, vc0);
            std::vector<int32_t> one = {0}, pos;
            for (int s = 0; s < ns; s++) {
                one.push_back(s + 1);
                pos.push_back(s % 2 ? p.lens[s] - 1 + (int32_t)(rnd32() % 200000) : p.lens[s] - 1);
            }
            /* one qkv buffer as the model's: q, k, v of a row side by side */
            const int64_t rs = (int64_t)(nh + 2 * nkv) * hd + 4, os = nh * hd + 8;
            std::vector<float> qkv = rand_vec(ns * rs, -2, 2), f = rand_vec(hd / 2, 1, 8);
            std::vector<float> wq = rand_vec(hd, 0.25, 2), wk = rand_vec(hd, 0.25, 2); /* Q/K norm weights */
            std::vector<float> bq = rand_vec((size_t)(nh + 2 * nkv) * hd, -1, 1); /* q/k/v biases side by side */
            int32_t *dip = dup(p.indptr), *dix = dup(p.indices), *dlp = dup(p.lpl), *done = dup(one),
                    *dp = dup(pos);
            float *dqkv = dup(qkv), *df = dup(f), *dwq = dup(wq), *dwk = dup(wk), *dbq = dup(bq), *dout, *dout2, *dws;
            const size_t n_cnt = m40k_decode_counter_ints(ns, nkv);
            int *dcnt = dup(std::vector<int>(n_cnt, 0));
            CK(cudaMalloc(&dout, (size_t)ns * os * 4));
            CK(cudaMalloc(&dout2, (size_t)ns * os * 4));
            CK(cudaMalloc(&dws, m40k_decode_workspace_floats(ns, nh, hd, 64) * 4));
            for (int rot : {hd, 24, 0}) /* 24: neox pairs that straddle a group of 8 */
                for (int neox : {0, 1})
                    for (int window : {0, 20})
                        for (float cap : {0.0f, 0.7f})
                        for (int splits : {1, 8, 16, 64}) {
                            const float *ffp = neox ? df : nullptr;
                            uint16_t *dkc = dup(kc0), *dvc = dup(vc0), *dkc2 = dup(kc0), *dvc2 = dup(vc0);
                            float *dq2 = dup(qkv); /* the two-kernel path rotates q in place */
                            CK(m40k_attn_decode_rope(dout, os, dqkv, rs, dqkv + nh * hd, rs, dqkv + (nh + nkv) * hd, rs,
                                                     dkc, dvc, dip, dix, dlp, ns, nh, nkv, hd, scale, window, cap, dp,
                                                     rot, base, ffp, neox, splits, dws, dcnt, nullptr, 0));
                            CK(m40k_kv_append_rope(dq2, rs, nh, dkc2, dvc2, dq2 + nh * hd, rs, dq2 + (nh + nkv) * hd,
                                                   rs, done, ns, ns, dip, dix, dlp, nkv, hd, dp, rot, base, ffp, neox,
                                                   0));
                            CK(m40k_attn_decode_window(dout2, os, dq2, rs, dkc2, dvc2, dip, dix, dlp, ns, nh, nkv, hd,
                                                       scale, window, cap, splits, dws, dcnt, 0));
                            std::vector<float> g = back(dout, (size_t)ns * os), g2 = back(dout2, (size_t)ns * os);
                            std::vector<uint16_t> gk = back(dkc, cache_elems), gv = back(dvc, cache_elems);
                            char what[128], w2[176];
                            snprintf(what, sizeof what,
                                     "attn_decode_rope hd %d G %d rot %d neox %d window %d cap %g splits %d", hd, G,
                                     rot, neox, window, cap, splits);
                            for (int s = 0; s < ns; s++) /* the gap past each row: not written */
                                for (int64_t j = (int64_t)nh * hd; j < os; j++)
                                    g[(size_t)s * os + j] = 0.0f, g2[(size_t)s * os + j] = 0.0f;
                            /* the new token is a tile of its own here: the same terms, summed
                             * in another grouping */
                            snprintf(w2, sizeof w2, "%s: out vs kv_append_rope + attn_decode", what);
                            compare(w2, g.data(), g2.data(), g.size(), 1e-5f, 1e-5f);
                            snprintf(w2, sizeof w2, "%s: caches == kv_append_rope's", what);
                            check(w2, gk == back(dkc2, cache_elems) && gv == back(dvc2, cache_elems));
                            snprintf(w2, sizeof w2, "%s: q, k, v unchanged", what);
                            check(w2, back(dqkv, qkv.size()) == qkv);
                            std::vector<int> cnt = back(dcnt, n_cnt);
                            snprintf(w2, sizeof w2, "%s: counters zero", what);
                            check(w2, std::all_of(cnt.begin(), cnt.end(), [](int v) { return v == 0; }));
                            /* the CPU twins */
                            std::vector<float> cq = qkv;
                            std::vector<uint16_t> ck = kc0, cv = vc0;
                            m40_ref_rope(cq.data(), rs, nh, cq.data() + nh * hd, rs, nkv, hd, rot, pos.data(), ns, base,
                                         neox ? f.data() : nullptr, neox);
                            m40_ref_kv_append(ck.data(), cv.data(), cq.data() + nh * hd, rs, cq.data() + (nh + nkv) * hd,
                                              rs, one.data(), ns, ns, p.indptr.data(), p.indices.data(), p.lpl.data(),
                                              nkv, hd);
                            std::vector<float> c((size_t)ns * os, 0.0f);
                            m40_ref_attn_decode_window(c.data(), os, cq.data(), rs, ck.data(), cv.data(),
                                                       p.indptr.data(), p.indices.data(), p.lpl.data(), ns, nh, nkv,
                                                       hd, scale, window, cap);
                            snprintf(w2, sizeof w2, "%s: vs cpu", what);
                            compare(w2, g.data(), c.data(), c.size(), 2e-4f, 1e-3f);
                            snprintf(w2, sizeof w2, "%s: v cache == cpu", what);
                            check(w2, gv == cv);
                            {
                                /* (g) out also as F16 (6e's out16): the same F32 out, and out16
                                 * the F16 of it bit for bit (the gap past each row unwritten) */
                                uint16_t *dkc6 = dup(kc0), *dvc6 = dup(vc0);
                                std::vector<uint16_t> fill((size_t)ns * os, 0x7e00);
                                uint16_t *do16 = dup(fill);
                                m40k_dec_opts o6 = {};
                                o6.out16 = do16;
                                CK(m40k_attn_decode_rope(dout2, os, dqkv, rs, dqkv + nh * hd, rs,
                                                         dqkv + (nh + nkv) * hd, rs, dkc6, dvc6, dip, dix, dlp, ns, nh,
                                                         nkv, hd, scale, window, cap, dp, rot, base, ffp, neox, splits,
                                                         dws, dcnt, &o6, 0));
                                std::vector<float> g6 = back(dout2, (size_t)ns * os);
                                std::vector<uint16_t> h6 = back(do16, (size_t)ns * os);
                                bool same = true, f16 = true;
                                for (int s = 0; s < ns; s++)
                                    for (int64_t j = 0; j < os; j++) {
                                        const size_t i = (size_t)s * os + j;
                                        if (j < (int64_t)nh * hd) {
                                            same &= memcmp(&g6[i], &g[i], 4) == 0;
                                            f16 &= h6[i] == m40_fp32_to_fp16(g[i]);
                                        } else {
                                            f16 &= h6[i] == 0x7e00;
                                        }
                                    }
                                snprintf(w2, sizeof w2, "%s: with out16, the same out", what);
                                check(w2, same);
                                snprintf(w2, sizeof w2, "%s: out16 == f16 of out", what);
                                check(w2, f16);
                                cudaFree(dkc6), cudaFree(dvc6), cudaFree(do16);
                            }
                            if (m40k_attn_decode_q8_ok(ns, nh, nkv, hd, splits)) {
                                /* (e) with the int8 records of out for the next GEMV: the same
                                 * out, and records byte for byte m40k_quantize_q8's of it */
                                uint16_t *dkc3 = dup(kc0), *dvc3 = dup(vc0);
                                float *dout3;
                                CK(cudaMalloc(&dout3, (size_t)ns * os * 4));
                                const size_t xq_bytes = m40k_gemv_q8_ws_bytes(nh * hd, ns);
                                uint8_t *dxq = dup(std::vector<uint8_t>(xq_bytes, 0xa5)),
                                        *dxq2 = dup(std::vector<uint8_t>(xq_bytes, 0));
                                CK(m40k_attn_decode_rope(dout3, os, dqkv, rs, dqkv + nh * hd, rs,
                                                         dqkv + (nh + nkv) * hd, rs, dkc3, dvc3, dip, dix, dlp, ns, nh,
                                                         nkv, hd, scale, window, cap, dp, rot, base, ffp, neox, splits,
                                                         dws, dcnt, dec_opts_q8(dxq), 0));
                                CK(m40k_quantize_q8(dout3, os, nh * hd, ns, dxq2, 0));
                                std::vector<float> g3 = back(dout3, (size_t)ns * os);
                                for (int s = 0; s < ns; s++)
                                    for (int64_t j = (int64_t)nh * hd; j < os; j++)
                                        g3[(size_t)s * os + j] = 0.0f;
                                snprintf(w2, sizeof w2, "%s: with int8 records, the same out", what);
                                check(w2, memcmp(g3.data(), g.data(), g.size() * 4) == 0);
                                snprintf(w2, sizeof w2, "%s: int8 records == quantize_q8 of out", what);
                                check(w2, back(dxq, xq_bytes) == back(dxq2, xq_bytes));
                                n_q8++;
                                cudaFree(dkc3), cudaFree(dvc3), cudaFree(dout3), cudaFree(dxq), cudaFree(dxq2);
                            }
                            if (splits <= 8)
                                for (int fv = 0; fv < 3; fv++) {
                                /* (f) with the per-head Q/K norms (fv 0), the q/k/v biases (1) or
                                 * both (2) in the kernel (6e): against the CPU twins (the biases
                                 * added, m40_ref_rmsnorm_heads, then (b)'s); the norms alone also
                                 * against m40k_rmsnorm_qk on a copy then the call without them
                                 * (the heads' sums of squares in another order: out to 1e-4, K's
                                 * F16 to one step) */
                                const bool nrm = fv != 1, bia = fv != 0;
                                uint16_t *dkc4 = dup(kc0), *dvc4 = dup(vc0);
                                m40k_dec_opts o4 = {};
                                if (nrm)
                                    o4.q_norm = dwq, o4.k_norm = dwk, o4.norm_eps = 1e-6f;
                                if (bia)
                                    o4.bias_q = dbq, o4.bias_k = dbq + nh * hd, o4.bias_v = dbq + (nh + nkv) * hd;
                                CK(m40k_attn_decode_rope(dout, os, dqkv, rs, dqkv + nh * hd, rs, dqkv + (nh + nkv) * hd,
                                                         rs, dkc4, dvc4, dip, dix, dlp, ns, nh, nkv, hd, scale, window,
                                                         cap, dp, rot, base, ffp, neox, splits, dws, dcnt, &o4, 0));
                                std::vector<float> n4 = back(dout, (size_t)ns * os);
                                for (int s = 0; s < ns; s++)
                                    for (int64_t j = (int64_t)nh * hd; j < os; j++)
                                        n4[(size_t)s * os + j] = 0.0f;
                                const char *fn = fv == 0 ? "Q/K norms" : fv == 1 ? "q/k/v biases" : "biases and norms";
                                if (fv == 0) {
                                    uint16_t *dkc5 = dup(kc0), *dvc5 = dup(vc0);
                                    float *dq5 = dup(qkv);
                                    CK(m40k_rmsnorm_qk(dq5, rs, nh, nkv, hd, dwq, dwk, ns, 1e-6f, 0));
                                    CK(m40k_attn_decode_rope(dout2, os, dq5, rs, dq5 + nh * hd, rs,
                                                             dq5 + (nh + nkv) * hd, rs, dkc5, dvc5, dip, dix, dlp, ns,
                                                             nh, nkv, hd, scale, window, cap, dp, rot, base, ffp, neox,
                                                             splits, dws, dcnt, nullptr, 0));
                                    std::vector<float> n5 = back(dout2, (size_t)ns * os);
                                    for (int s = 0; s < ns; s++)
                                        for (int64_t j = (int64_t)nh * hd; j < os; j++)
                                            n5[(size_t)s * os + j] = 0.0f;
                                    snprintf(w2, sizeof w2, "%s: Q/K norms in the kernel vs rmsnorm_qk first", what);
                                    compare(w2, n4.data(), n5.data(), n4.size(), 1e-4f, 1e-4f);
                                    std::vector<float> k4 = h2f(back(dkc4, cache_elems)),
                                                       k5 = h2f(back(dkc5, cache_elems));
                                    snprintf(w2, sizeof w2, "%s: Q/K norms: K cache vs rmsnorm_qk first", what);
                                    compare(w2, k4.data(), k5.data(), k4.size(), 1e-3f, 1e-3f);
                                    snprintf(w2, sizeof w2, "%s: Q/K norms: V cache == rmsnorm_qk first's", what);
                                    check(w2, back(dvc4, cache_elems) == back(dvc5, cache_elems));
                                    cudaFree(dkc5), cudaFree(dvc5), cudaFree(dq5);
                                }
                                snprintf(w2, sizeof w2, "%s: %s: q, k, v unchanged", what, fn);
                                check(w2, back(dqkv, qkv.size()) == qkv);
                                std::vector<float> nq = qkv;
                                std::vector<uint16_t> nk = kc0, nv = vc0;
                                if (bia)
                                    for (int s = 0; s < ns; s++)
                                        for (int j = 0; j < (nh + 2 * nkv) * hd; j++)
                                            nq[(size_t)s * rs + j] += bq[j];
                                if (nrm) {
                                    m40_ref_rmsnorm_heads(nq.data(), rs, nh, hd, wq.data(), ns, 1e-6f);
                                    m40_ref_rmsnorm_heads(nq.data() + nh * hd, rs, nkv, hd, wk.data(), ns, 1e-6f);
                                }
                                m40_ref_rope(nq.data(), rs, nh, nq.data() + nh * hd, rs, nkv, hd, rot, pos.data(), ns,
                                             base, neox ? f.data() : nullptr, neox);
                                m40_ref_kv_append(nk.data(), nv.data(), nq.data() + nh * hd, rs,
                                                  nq.data() + (nh + nkv) * hd, rs, one.data(), ns, ns, p.indptr.data(),
                                                  p.indices.data(), p.lpl.data(), nkv, hd);
                                std::vector<float> nc((size_t)ns * os, 0.0f);
                                m40_ref_attn_decode_window(nc.data(), os, nq.data(), rs, nk.data(), nv.data(),
                                                           p.indptr.data(), p.indices.data(), p.lpl.data(), ns, nh, nkv,
                                                           hd, scale, window, cap);
                                snprintf(w2, sizeof w2, "%s: %s in the kernel vs cpu", what, fn);
                                compare(w2, n4.data(), nc.data(), nc.size(), 2e-4f, 1e-3f);
                                snprintf(w2, sizeof w2, "%s: %s: v cache == cpu", what, fn);
                                check(w2, back(dvc4, cache_elems) == nv);
                                n_qkn++;
                                cudaFree(dkc4), cudaFree(dvc4);
                            }
                            cudaFree(dkc), cudaFree(dvc), cudaFree(dkc2), cudaFree(dvc2), cudaFree(dq2);
                        }
            cudaFree(dip), cudaFree(dix), cudaFree(dlp), cudaFree(done), cudaFree(dp), cudaFree(dqkv), cudaFree(df),
                cudaFree(dwq), cudaFree(dwk), cudaFree(dbq), cudaFree(dout), cudaFree(dout2), cudaFree(dws), cudaFree(dcnt);
        }
    check("attn_decode_rope with norms or biases: cases ran", n_qkn == 10 * 3 * 2 * 2 * 2 * 2 * 3);
    int cc = 0, sms = 0;
    CK(cudaDeviceGetAttribute(&cc, cudaDevAttrComputeCapabilityMajor, 0));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    if (cc >= 9) { /* the cluster merge runs (sm_90) */
        check("attn_decode_rope out_q8: int8 records written in some cases", n_q8 > 0);
        /* Mistral-7B's heads at batch 1, ~600 positions: the engine's split pick (bucket 1024) */
        check("attn_decode_q8_ok: 1 sequence, 32/8 heads of 128, the engine's splits",
              m40k_attn_decode_q8_ok(1, 32, 8, 128, m40k_decode_pick_splits(1, 8, 1024, sms)) == 1);
    }
    check("attn_decode_q8_ok: not for 9 sequences", m40k_attn_decode_q8_ok(9, 32, 8, 128, 2) == 0);
    check("attn_decode_q8_ok: not with one split", m40k_attn_decode_q8_ok(1, 32, 8, 128, 1) == 0);
    /* refused: odd or too long rot_dim, base 0, misaligned k (before any launch) */
    float *pf = (float *)16;
    uint16_t *ph = (uint16_t *)16;
    const int32_t *pi = (const int32_t *)16;
    check("attn_decode_rope odd rot_dim refused",
          m40k_attn_decode_rope(pf, 64, pf, 64, pf, 64, pf, 64, ph, ph, pi, pi, pi, 1, 1, 1, 64, 1.0f, 0, 0.0f, pi, 31,
                                10000.0f, nullptr, 0, 1, nullptr, nullptr, nullptr, 0) != 0);
    check("attn_decode_rope rot_dim > head_dim refused",
          m40k_attn_decode_rope(pf, 64, pf, 64, pf, 64, pf, 64, ph, ph, pi, pi, pi, 1, 1, 1, 64, 1.0f, 0, 0.0f, pi, 66,
                                10000.0f, nullptr, 0, 1, nullptr, nullptr, nullptr, 0) != 0);
    check("attn_decode_rope base 0 refused",
          m40k_attn_decode_rope(pf, 64, pf, 64, pf, 64, pf, 64, ph, ph, pi, pi, pi, 1, 1, 1, 64, 1.0f, 0, 0.0f, pi, 64,
                                0.0f, nullptr, 0, 1, nullptr, nullptr, nullptr, 0) != 0);
    {
        /* 6e refuses half of a pair of norms, a negative eps, a q bias without k and v */
        m40k_dec_opts o = {};
        o.q_norm = pf, o.norm_eps = 1e-6f;
        check("attn_decode_rope: q_norm without k_norm refused",
              m40k_attn_decode_rope(pf, 64, pf, 64, pf, 64, pf, 64, ph, ph, pi, pi, pi, 1, 1, 1, 64, 1.0f, 0, 0.0f, pi,
                                    64, 10000.0f, nullptr, 0, 1, nullptr, nullptr, &o, 0) != 0);
        o.k_norm = pf, o.norm_eps = -1.0f;
        check("attn_decode_rope: negative eps refused",
              m40k_attn_decode_rope(pf, 64, pf, 64, pf, 64, pf, 64, ph, ph, pi, pi, pi, 1, 1, 1, 64, 1.0f, 0, 0.0f, pi,
                                    64, 10000.0f, nullptr, 0, 1, nullptr, nullptr, &o, 0) != 0);
        o = m40k_dec_opts{};
        o.bias_q = pf;
        check("attn_decode_rope: a q bias without k and v biases refused",
              m40k_attn_decode_rope(pf, 64, pf, 64, pf, 64, pf, 64, ph, ph, pi, pi, pi, 1, 1, 1, 64, 1.0f, 0, 0.0f, pi,
                                    64, 10000.0f, nullptr, 0, 1, nullptr, nullptr, &o, 0) != 0);
    }
    check("attn_decode_rope out_q8 with one split refused (no cluster merge)",
          m40k_attn_decode_rope(pf, 64, pf, 64, pf, 64, pf, 64, ph, ph, pi, pi, pi, 1, 1, 1, 64, 1.0f, 0, 0.0f, pi, 64,
                                10000.0f, nullptr, 0, 1, nullptr, nullptr, dec_opts_q8((void *)ph), 0) != 0);
    check("attn_decode_rope negative soft-cap refused",
          m40k_attn_decode_rope(pf, 64, pf, 64, pf, 64, pf, 64, ph, ph, pi, pi, pi, 1, 1, 1, 64, 1.0f, 0, -1.0f, pi, 64,
                                10000.0f, nullptr, 0, 1, nullptr, nullptr, nullptr, 0) != 0);
    check("attn_decode_rope misaligned k refused",
          m40k_attn_decode_rope(pf, 64, pf, 64, pf + 1, 64, pf, 64, ph, ph, pi, pi, pi, 1, 1, 1, 64, 1.0f, 0, 0.0f, pi,
                                64, 10000.0f, nullptr, 0, 1, nullptr, nullptr, nullptr, 0) != 0);
}

/* ---------------------------------------------------------------- 5b. kv append with RoPE on K */
/* m40k_kv_append_rope against (a) m40k_rope on q and k then m40k_kv_append, byte for
 * byte, both caches and q, (b) the CPU twins m40_ref_rope + m40_ref_kv_append: V
 * exactly, K within the rope test's tolerance widened by one F16 step (two floats that
 * close may round to neighbouring halves), q within the rope test's tolerance, (c) k as
 * it was. q NULL (K only) for head_dim 64. Sequence sets: a decode step (one new token
 * each) and a mixed one (prompt chunks across page boundaries); positions are the cache
 * positions for even sequences and large random ones for odd sequences. */
static void test_kv_append_rope(void)
{
    const std::vector<int> lens_sets[2] = {{5, 16, 17, 33, 1000}, {1, 15, 16, 17, 100, 1000}};
    const std::vector<int> news_sets[2] = {{1, 1, 1, 1, 1}, {1, 15, 3, 17, 100, 37}};
    for (int hd : {64, 128, 256})
        for (int rot : {hd, 32, 0})
            for (int neox : {0, 1})
                for (int ff : {0, 1})
                    for (int set : {0, 1}) {
                        const int nkv = hd == 64 ? 3 : 2;
                        const std::vector<int> &news = news_sets[set];
                        Paged p = make_paged(lens_sets[set]);
                        const size_t cache_elems = (size_t)p.n_blocks * nkv * M40K_PAGE * hd;
                        std::vector<uint16_t> kc(cache_elems), vc(cache_elems);
                        for (size_t i = 0; i < cache_elems; i++)
                            kc[i] = m40_fp32_to_fp16(frand(-1, 1)), vc[i] = m40_fp32_to_fp16(frand(-1, 1));
                        std::vector<int32_t> new_indptr = {0}, pos;
                        for (int s = 0; s < p.n_seqs; s++) {
                            new_indptr.push_back(new_indptr.back() + news[s]);
                            for (int j = 0; j < news[s]; j++) {
                                const int cp = p.lens[s] - news[s] + j;
                                pos.push_back(s % 2 ? cp + (int32_t)(rnd32() % 200000) : cp);
                            }
                        }
                        const int nt = new_indptr.back();
                        const int64_t ks = nkv * hd + 4, vs = nkv * hd + 8;
                        const float base = 500000.0f;
                        std::vector<float> k = rand_vec(nt * ks, -2, 2), v = rand_vec(nt * vs, -2, 2),
                                           f = rand_vec(rot / 2, 1, 8);
                        const bool use_q = hd != 64;
                        const int nh = 3 * nkv;
                        const int64_t qs = nh * hd + 2;
                        std::vector<float> qv = rand_vec(nt * qs, -2, 2);
                        float *dq = dup(qv), *dq2 = dup(qv);

                        /* the fused kernel, then the two-kernel path on a second copy */
                        uint16_t *dkc = dup(kc), *dvc = dup(vc), *dkc2 = dup(kc), *dvc2 = dup(vc);
                        int32_t *dip = dup(p.indptr), *dix = dup(p.indices), *dlp = dup(p.lpl), *dni = dup(new_indptr),
                                *dp = dup(pos);
                        float *dk = dup(k), *dv = dup(v), *dk2 = dup(k), *df = dup(f);
                        const float *ffp = ff ? df : nullptr;
                        CK(m40k_kv_append_rope(use_q ? dq : nullptr, qs, nh, dkc, dvc, dk, ks, dv, vs, dni, p.n_seqs,
                                               nt, dip, dix, dlp, nkv, hd, dp, rot, base, ffp, neox, 0));
                        CK(m40k_rope(use_q ? dq2 : nullptr, qs, use_q ? nh : 0, dk2, ks, nkv, hd, rot, dp, nt, base,
                                     ffp, neox, 0));
                        CK(m40k_kv_append(dkc2, dvc2, dk2, ks, dv, vs, dni, p.n_seqs, nt, dip, dix, dlp, nkv, hd, 0));
                        std::vector<uint16_t> gk = back(dkc, cache_elems), gv = back(dvc, cache_elems);
                        char what[128];
                        snprintf(what, sizeof what, "kv_append_rope hd %d rot %d neox %d ff %d %s tokens %d", hd, rot,
                                 neox, ff, set ? "mixed" : "decode", nt);
                        char w2[160];
                        snprintf(w2, sizeof w2, "%s: cache == rope + kv_append", what);
                        check(w2, gk == back(dkc2, cache_elems) && gv == back(dvc2, cache_elems));
                        snprintf(w2, sizeof w2, "%s: k unchanged", what);
                        check(w2, back(dk, k.size()) == k);
                        std::vector<float> gq = back(dq, qv.size());
                        snprintf(w2, sizeof w2, "%s: q == rope%s", what, use_q ? "" : " (q NULL: untouched)");
                        check(w2, gq == (use_q ? back(dq2, qv.size()) : qv));
                        if (use_q) {
                            std::vector<float> qr = qv;
                            m40_ref_rope(qr.data(), qs, nh, nullptr, 0, 0, hd, rot, pos.data(), nt, base,
                                         ff ? f.data() : nullptr, neox);
                            snprintf(w2, sizeof w2, "%s: q vs cpu", what);
                            compare(w2, gq.data(), qr.data(), qr.size(), 1e-5f, 1e-5f);
                        }

                        { /* the angle table (5c) and the append that reads it: the same bits */
                            const int half = rot / 2;
                            float *dcs;
                            CK(cudaMalloc(&dcs, (size_t)nt * (rot > 0 ? rot : 2) * sizeof(float)));
                            CK(m40k_rope_table(dp, nt, rot, base, ffp, dcs, 0));
                            uint16_t *dkc4 = dup(kc), *dvc4 = dup(vc);
                            float *dq4 = dup(qv);
                            CK(m40k_kv_append_rope_tab(use_q ? dq4 : nullptr, qs, nh, dkc4, dvc4, dk, ks, dv, vs, dni,
                                                       p.n_seqs, nt, dip, dix, dlp, nkv, hd, rot, dcs, neox, 0));
                            snprintf(w2, sizeof w2, "%s: the table's append == the fused kernel's", what);
                            check(w2, back(dkc4, cache_elems) == gk && back(dvc4, cache_elems) == gv &&
                                          back(dq4, qv.size()) == gq);
                            if (use_q) { /* q rows 16-byte aligned: the four-wide kernel rotates q too */
                                const int64_t qs4 = (int64_t)nh * hd + 4;
                                std::vector<float> q4((size_t)nt * qs4, 0.0f);
                                for (int t = 0; t < nt; t++)
                                    memcpy(&q4[(size_t)t * qs4], &qv[(size_t)t * qs], (size_t)nh * hd * sizeof(float));
                                float *dq5 = dup(q4);
                                uint16_t *dkc5 = dup(kc), *dvc5 = dup(vc);
                                CK(m40k_kv_append_rope_tab(dq5, qs4, nh, dkc5, dvc5, dk, ks, dv, vs, dni, p.n_seqs, nt,
                                                           dip, dix, dlp, nkv, hd, rot, dcs, neox, 0));
                                std::vector<float> g5 = back(dq5, q4.size());
                                bool same = true;
                                for (int t = 0; t < nt; t++)
                                    same = same && memcmp(&g5[(size_t)t * qs4], &gq[(size_t)t * qs],
                                                          (size_t)nh * hd * sizeof(float)) == 0;
                                snprintf(w2, sizeof w2, "%s: the table's append, aligned q == the fused kernel's", what);
                                check(w2, same && back(dkc5, cache_elems) == gk && back(dvc5, cache_elems) == gv);
                                cudaFree(dq5), cudaFree(dkc5), cudaFree(dvc5);
                            }
                            if (half > 0) { /* the table against the angles in double on the CPU */
                                std::vector<float> tab = back(dcs, (size_t)nt * rot);
                                double worst = 0.0;
                                for (int t = 0; t < nt; t++)
                                    for (int i = 0; i < half; i++) {
                                        double th = pos[t] * pow((double)base, -2.0 * i / rot);
                                        if (ff)
                                            th /= f[i];
                                        const double ec = fabs(tab[2 * ((size_t)t * half + i)] - cos(th)),
                                                     es = fabs(tab[2 * ((size_t)t * half + i) + 1] - sin(th));
                                        worst = fmax(worst, fmax(ec, es));
                                    }
                                snprintf(w2, sizeof w2, "%s: table vs cpu (%.2g)", what, worst);
                                check(w2, worst < 2e-6);
                            }
                            cudaFree(dcs), cudaFree(dkc4), cudaFree(dvc4), cudaFree(dq4);
                        }

                        if (set == 1) { /* the same call in two slices of the tables (forward's decode/prefill split) */
                            const int m = 2, r = new_indptr[m];
                            uint16_t *dkc3 = dup(kc), *dvc3 = dup(vc);
                            float *dq3 = dup(qv);
                            CK(m40k_kv_append_rope(use_q ? dq3 : nullptr, qs, nh, dkc3, dvc3, dk, ks, dv, vs, dni, m, r,
                                                   dip, dix, dlp, nkv, hd, dp, rot, base, ffp, neox, 0));
                            CK(m40k_kv_append_rope(use_q ? dq3 + r * qs : nullptr, qs, nh, dkc3, dvc3, dk + r * ks, ks,
                                                   dv + r * vs, vs, dni + m, p.n_seqs - m, nt - r, dip + m, dix,
                                                   dlp + m, nkv, hd, dp + r, rot, base, ffp, neox, 0));
                            snprintf(w2, sizeof w2, "%s: two slices == one call", what);
                            check(w2, back(dkc3, cache_elems) == gk && back(dvc3, cache_elems) == gv &&
                                          back(dq3, qv.size()) == gq);
                            cudaFree(dkc3), cudaFree(dvc3), cudaFree(dq3);
                        }
                        std::vector<float> kr = k; /* the twins rotate in place */
                        m40_ref_rope(nullptr, 0, 0, kr.data(), ks, nkv, hd, rot, pos.data(), nt, base,
                                     ff ? f.data() : nullptr, neox);
                        m40_ref_kv_append(kc.data(), vc.data(), kr.data(), ks, v.data(), vs, new_indptr.data(),
                                          p.n_seqs, nt, p.indptr.data(), p.indices.data(), p.lpl.data(), nkv, hd);
                        snprintf(w2, sizeof w2, "%s: v cache == cpu", what);
                        check(w2, gv == vc);
                        snprintf(w2, sizeof w2, "%s: k cache vs cpu", what);
                        std::vector<float> g = h2f(gk), c = h2f(kc);
                        compare(w2, g.data(), c.data(), c.size(), 1e-5f, 1e-5f + 1.0f / 1024);
                        cudaFree(dkc), cudaFree(dvc), cudaFree(dkc2), cudaFree(dvc2), cudaFree(dip), cudaFree(dix),
                            cudaFree(dlp), cudaFree(dni), cudaFree(dp), cudaFree(dk), cudaFree(dv), cudaFree(dk2),
                            cudaFree(df), cudaFree(dq), cudaFree(dq2);
                    }
    /* refused as m40k_rope refuses: odd or too long rot_dim, base <= 0 (checked before
     * any launch, so no device memory is needed) */
    check("kv_append_rope odd rot_dim refused",
          m40k_kv_append_rope(nullptr, 0, 0, nullptr, nullptr, nullptr, 8, nullptr, 8, nullptr, 1, 1, nullptr, nullptr,
                              nullptr, 1, 64, nullptr, 31, 10000.0f, nullptr, 0, 0) != 0);
    check("kv_append_rope rot_dim > head_dim refused",
          m40k_kv_append_rope(nullptr, 0, 0, nullptr, nullptr, nullptr, 8, nullptr, 8, nullptr, 1, 1, nullptr, nullptr,
                              nullptr, 1, 64, nullptr, 66, 10000.0f, nullptr, 0, 0) != 0);
    check("kv_append_rope_tab without a table refused",
          m40k_kv_append_rope_tab(nullptr, 0, 0, nullptr, nullptr, nullptr, 8, nullptr, 8, nullptr, 1, 1, nullptr,
                                  nullptr, nullptr, 1, 64, 64, nullptr, 0, 0) != 0);
    check("rope_table odd rot_dim refused", m40k_rope_table(nullptr, 1, 31, 10000.0f, nullptr, nullptr, 0) != 0);
    check("kv_append_rope base 0 refused",
          m40k_kv_append_rope(nullptr, 0, 0, nullptr, nullptr, nullptr, 8, nullptr, 8, nullptr, 1, 1, nullptr, nullptr,
                              nullptr, 1, 64, nullptr, 64, 0.0f, nullptr, 0, 0) != 0);
}

/* ---------------------------------------------------------------- 8. gemv */
static const int gemv_types[] = {M40K_TYPE_F16,  M40K_TYPE_BF16, M40K_TYPE_Q8_0, M40K_TYPE_Q4_0,
                                 M40K_TYPE_Q4_1, M40K_TYPE_Q5_0, M40K_TYPE_Q5_1, M40K_TYPE_Q2_K,
                                 M40K_TYPE_Q3_K, M40K_TYPE_Q4_K, M40K_TYPE_Q5_K, M40K_TYPE_Q6_K};

static void test_gemv(void)
{
    /* K 608 (19 blocks of 32): F16 ends in a partial segment, Q8_0/Q4_0 rows are not
     * 16-byte multiples and take the generic kernel; the rest take the fast kernel.
     * Q4_1/Q5_0/Q5_1 always take the generic kernel; K 640 is Gemma 3 270M's width. */
    for (int type : gemv_types)
        for (int K : {256 * 3, 256 * 9, 4096 + 256, 608, 640})
            for (int N : {1, 17, 259})
                for (int batch : {1, 3, 8}) {
                    if (K % m40_type_get((uint32_t)type)->block_elems)
                        continue;
                    std::vector<uint8_t> w = quant_matrix(type, N, K);
                    const int64_t xs = K + 4, ys = N + 1;
                    std::vector<float> x = rand_vec(batch * xs), c(batch * ys, 0.0f);
                    m40_ref_gemv(w.data(), type, N, K, x.data(), xs, c.data(), ys, batch);
                    /* tolerance from the row's magnitude: sum |w||x| */
                    std::vector<float> deq(K);
                    double mag = 0;
                    for (int n = 0; n < N; n++) {
                        m40_dequantize_row((uint32_t)type, w.data() + n * row_bytes(type, K), deq.data(), K);
                        double m = 0;
                        for (int i = 0; i < K; i++)
                            m += fabs(deq[i]);
                        mag = std::max(mag, m);
                    }
                    uint8_t *dw = dup(w);
                    float *dx = dup(x), *dy;
                    CK(cudaMalloc(&dy, c.size() * 4));
                    CK(cudaMemset(dy, 0, c.size() * 4));
                    CK(m40k_gemv(dw, type, N, K, dx, xs, dy, ys, batch, 0));
                    std::vector<float> g = back(dy, c.size());
                    char what[96];
                    snprintf(what, sizeof what, "gemv %s N %d K %d batch %d", m40_type_name(type), N, K, batch);
                    compare(what, g.data(), c.data(), c.size(), (float)(2e-6 * mag), 1e-4f);
                    if (N == 17 && batch == 3) { /* W at an address that is not 16-byte aligned: generic kernel */
                        uint8_t *dw2;
                        CK(cudaMalloc(&dw2, w.size() + 16));
                        CK(cudaMemcpy(dw2 + 2, w.data(), w.size(), cudaMemcpyHostToDevice));
                        CK(cudaMemset(dy, 0, c.size() * 4));
                        CK(m40k_gemv(dw2 + 2, type, N, K, dx, xs, dy, ys, batch, 0));
                        g = back(dy, c.size());
                        snprintf(what, sizeof what, "gemv %s N %d K %d batch %d W+2", m40_type_name(type), N, K, batch);
                        compare(what, g.data(), c.data(), c.size(), (float)(2e-6 * mag), 1e-4f);
                        cudaFree(dw2);
                    }
                    cudaFree(dw), cudaFree(dx), cudaFree(dy);
                }
}

/* One split count's checks, as every split-K product's test makes them (skinny, gemm_q,
 * gemm_x8): run() writes y (rows x ldy floats) into dy, which holds -7 before; the result
 * against the twin c (atol, rtol) as "<name>", the columns N .. ldy-1 left at -7 ("<name>:
 * ldy gap kept"), the same bits from a second run ("<name>: same bits again") and the ncnt
 * counters at dcnt back at zero ("<name>: counters zero"). Returns the first result, its
 * gap columns zeroed as the twin's. */
template <typename F>
static std::vector<float> check_split_run(const char *name, F run, float *dy, const std::vector<float> &c, int rows,
                                          int N, int64_t ldy, float atol, float rtol, const int *dcnt, size_t ncnt)
{
    std::vector<float> sentinel(c.size(), -7.0f);
    CK(cudaMemcpy(dy, sentinel.data(), c.size() * 4, cudaMemcpyHostToDevice));
    run();
    std::vector<float> g = back(dy, c.size());
    bool gaps = true;
    for (int t = 0; t < rows; t++)
        for (int64_t r = N; r < ldy; r++) {
            gaps = gaps && g[(size_t)t * ldy + r] == -7.0f;
            g[(size_t)t * ldy + r] = 0.0f; /* the twin's zeros there */
        }
    char what[192];
    compare(name, g.data(), c.data(), c.size(), atol, rtol);
    snprintf(what, sizeof what, "%s: ldy gap kept", name);
    check(what, gaps);
    run();
    std::vector<float> g2 = back(dy, c.size());
    bool same = true;
    for (int t = 0; t < rows; t++)
        for (int r = 0; r < N; r++)
            same = same && memcmp(&g2[(size_t)t * ldy + r], &g[(size_t)t * ldy + r], 4) == 0;
    snprintf(what, sizeof what, "%s: same bits again", name);
    check(what, same);
    std::vector<int> cnt = back(dcnt, ncnt);
    snprintf(what, sizeof what, "%s: counters zero", name);
    check(what, std::all_of(cnt.begin(), cnt.end(), [](int v) { return v == 0; }));
    return g;
}

/* 8c. Tensor-core F16 GEMV (m40k_gemm_skinny) against its twin, m40_ref_gemv of the F16
 * weights on x rounded to F16 (exact products, double sums: only the order of the sum
 * differs). Batch rows 1..8, N not a multiple of the 128-row block, K of one and of many
 * 128-wide steps, x rows strided (K + 4), split counts 1, picked and the most (one step
 * a split). Also: y columns past N (ldy > N) left alone, the same bits on a second call
 * (ordered split sums), the split counters back at zero after every call. */
static void test_gemm_skinny(void)
{
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    for (int K : {128, 640, 1152, 4096 + 128})
        for (int N : {1, 17, 130, 259})
            for (int n : {1, 2, 3, 5, 8}) {
                const int64_t xs = K + 4, ldy = N + 3;
                std::vector<float> wf = rand_vec((size_t)N * K), x = rand_vec((size_t)n * xs);
                std::vector<uint16_t> w(wf.size());
                for (size_t i = 0; i < wf.size(); i++)
                    w[i] = m40_fp32_to_fp16(wf[i]);
                std::vector<float> xr(x.size());
                for (size_t i = 0; i < x.size(); i++)
                    xr[i] = m40_fp16_to_fp32(m40_fp32_to_fp16(x[i]));
                std::vector<float> c((size_t)n * ldy, 0.0f);
                m40_ref_gemv(w.data(), M40K_TYPE_F16, N, K, xr.data(), xs, c.data(), ldy, n);
                double mag = 0; /* sum_k |w||x| <= sum_k |w| (|x| <= 1) */
                for (int r = 0; r < N; r++) {
                    double m = 0;
                    for (int k = 0; k < K; k++)
                        m += fabs(m40_fp16_to_fp32(w[(size_t)r * K + k]));
                    mag = std::max(mag, m);
                }
                uint16_t *dw = dup(w);
                float *dx = dup(x), *dy, *dws;
                const int maxS = K / 128;
                CK(cudaMalloc(&dy, c.size() * 4));
                CK(cudaMalloc(&dws, m40k_gemm_skinny_ws_floats(N, n, maxS) * 4 + 16));
                int *dcnt = dup(std::vector<int>(m40k_gemm_skinny_counter_ints(N), 0));
                const int pick = m40k_gemm_skinny_pick_splits(N, K, n, sms, m40k_gemm_skinny_ws_floats(N, n, maxS),
                                                              m40k_gemm_skinny_counter_ints(N));
                check("gemm_skinny pick in 1..K/128", pick >= 1 && pick <= maxS);
                for (int S : {1, pick, maxS}) {
                    char name[112];
                    snprintf(name, sizeof name, "gemm_skinny N %d K %d n %d splits %d", N, K, n, S);
                    check_split_run(
                        name, [&] { CK(m40k_gemm_skinny(dw, N, K, dx, xs, n, dy, ldy, S, dws, dcnt, 0)); }, dy, c, n,
                        N, ldy, (float)(2e-6 * mag), 1e-4f, dcnt, m40k_gemm_skinny_counter_ints(N));
                }
                cudaFree(dw), cudaFree(dx), cudaFree(dy), cudaFree(dws), cudaFree(dcnt);
            }
    /* refused shapes: K not a multiple of 128, more than 8 rows, splits past K/128 */
    const uint16_t *pw = (const uint16_t *)16;
    const float *px = (const float *)16;
    float *py = (float *)16;
    check("gemm_skinny refuses K 96", m40k_gemm_skinny(pw, 4, 96, px, 96, 1, py, 4, 1, NULL, NULL, 0) != 0);
    check("gemm_skinny refuses n 9", m40k_gemm_skinny(pw, 4, 128, px, 128, 9, py, 4, 1, NULL, NULL, 0) != 0);
    check("gemm_skinny refuses 2 splits of K 128",
          m40k_gemm_skinny(pw, 4, 128, px, 128, 1, py, 4, 2, py, (int *)16, 0) != 0);
}

/* m40k_gemm_q_dequant of the device weights dw (N x K of type; w: the same matrix in the
 * file's type base) against its twin m40_ref_gemm_q_dequant: the same F16 bits but rare
 * ties one ulp apart; refused where the type has no staged chunk. */
static void check_dequant(int type, int base, const char *sfx, const std::vector<uint8_t> &w, const uint8_t *dw, int N,
                          int K)
{
    uint16_t *dq;
    CK(cudaMalloc(&dq, (size_t)N * K * 2));
    const int e = m40k_gemm_q_dequant(dw, type, N, K, dq, 0);
    const bool takes = K % 256 == 0 && type != M40K_TYPE_F16 && type != M40K_TYPE_Q6_K && type != M40K_TYPE_BF16 &&
                       type != M40K_TYPE_Q2_K && type != M40K_TYPE_Q3_K && type != M40K_TYPE_Q5_K;
    char what[128];
    snprintf(what, sizeof what, "gemm_q_dequant %s%s N %d K %d %s", m40_type_name(base), sfx, N, K,
             takes ? "runs" : "refuses");
    check(what, takes ? e == 0 : e != 0);
    if (takes && e == 0) {
        std::vector<uint16_t> got = back(dq, (size_t)N * K), ref((size_t)N * K);
        m40_ref_gemm_q_dequant(w.data(), base, N, K, ref.data());
        size_t far = 0, off1 = 0;
        for (size_t i = 0; i < got.size(); i++)
            if (got[i] != ref[i]) {
                const int d = abs((int)(got[i] & 0x7fff) - (int)(ref[i] & 0x7fff));
                if (d == 1 && (got[i] & 0x8000) == (ref[i] & 0x8000))
                    off1++;
                else
                    far++;
            }
        snprintf(what, sizeof what, "gemm_q_dequant %s%s N %d K %d: %zu of %zu one ulp off", m40_type_name(base), sfx,
                 N, K, off1, got.size());
        check(what, far == 0 && off1 * 1000 <= got.size());
    }
    cudaFree(dq);
}

/* 8e. The quantized tensor-core GEMM (m40k_gemm_q) against its twin m40_ref_gemm_q (the
 * weights dequantized and rounded to F16, x F16, double sums: only the order of the sum
 * and, rarely, the last F16 bit of a weight differ). Every type it reads, the regrouped
 * layouts through a repacked copy of the same matrix; N past the 128-row block; K with a
 * partial last 64-wide step (32-element types) and of several steps; M in every tile
 * height (16, 32, 64, 128) and past one tile (1..64 rows of Q4_K and the G8 layouts: the
 * register kernel; the rest: the shared-memory one); x rows strided; split counts 1,
 * picked and the most (the register kernel's picked count at each of its block sizes,
 * 96 rows leaving two warps idle, a last block partly past N). Also: y columns past N left alone, the same bits again, the
 * counters back at zero, the unaligned copy on the direct kernel, refusals, and the F16
 * weights of m40k_gemm_q_dequant against m40_ref_gemm_q_dequant. */
static void test_gemm_q(void)
{
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int types[] = {M40K_TYPE_F16,  M40K_TYPE_Q8_0, M40K_TYPE_Q4_0, M40K_TYPE_Q4_1,    M40K_TYPE_Q5_0,
                         M40K_TYPE_Q5_1, M40K_TYPE_Q4_K, M40K_TYPE_Q6_K, M40K_TYPE_Q8_0_G8, M40K_TYPE_Q6_K_G8,
                         M40K_TYPE_Q6_K_P, M40K_TYPE_Q2_K, M40K_TYPE_Q3_K, M40K_TYPE_Q5_K, M40K_TYPE_BF16};
    for (int type : types) {
        const int base = dev_base(type);
        const char *sfx = dev_suffix(type);
        const int be = m40_type_get((uint32_t)base)->block_elems;
        std::vector<int> Ks;
        if (type == M40K_TYPE_Q6_K_G8)
            Ks = {2048, 4096};
        else if (type == M40K_TYPE_Q6_K_P)
            Ks = {256, 768, 256 * 5}; /* 768: the experts' down rows of Qwen3-30B-A3B */
        else if (be == 256 || type == M40K_TYPE_Q8_0_G8)
            Ks = {256, 256 * 5};
        else
            Ks = {32 * 37, 64 * 3, 768};
        for (int K : Ks)
            for (int N : {17, 259})
                for (int M : {1, 5, 9, 16, 27, 33, 64, 65, 130}) {
                    const int64_t xs = K + 8, ldy = N + 3;
                    std::vector<uint8_t> w = quant_matrix(base, N, K);
                    std::vector<uint8_t> wd = dev_layout(type, w, N, K);
                    std::vector<float> xf = rand_vec((size_t)M * xs);
                    std::vector<uint16_t> x(xf.size());
                    for (size_t i = 0; i < xf.size(); i++)
                        x[i] = m40_fp32_to_fp16(xf[i]);
                    std::vector<float> c((size_t)M * ldy, 0.0f);
                    m40_ref_gemm_q(w.data(), base, N, K, x.data(), xs, M, c.data(), ldy);
                    std::vector<float> wr((size_t)K);
                    double mag = 0; /* sum_k |w||x| <= sum_k |w| (|x| <= 1) */
                    for (int r = 0; r < N; r++) {
                        m40_dequantize_row((uint32_t)base, w.data() + (size_t)r * row_bytes(base, K), wr.data(), K);
                        double m = 0;
                        for (int k = 0; k < K; k++)
                            m += fabs(wr[k]);
                        mag = std::max(mag, m);
                    }
                    uint8_t *dw = dup(wd);
                    uint16_t *dx = dup(x);
                    if (M == 9)
                        check_dequant(type, base, sfx, w, dw, N, K);
                    float *dy, *dws;
                    const int maxS = (K + 255) / 256;
                    CK(cudaMalloc(&dy, c.size() * 4));
                    CK(cudaMalloc(&dws, m40k_gemm_q_ws_floats(N, M, maxS) * 4 + 16));
                    int *dcnt = dup(std::vector<int>(m40k_gemm_q_counter_ints(N, M), 0));
                    const int pick = m40k_gemm_q_pick_splits(type, N, K, M, sms, m40k_gemm_q_ws_floats(N, M, maxS),
                                                             m40k_gemm_q_counter_ints(N, M));
                    check("gemm_q pick in 1..K/256", pick >= 1 && pick <= maxS);
                    for (int S : {1, pick, maxS}) {
                        char what[128];
                        snprintf(what, sizeof what, "gemm_q %s%s N %d K %d M %d splits %d", m40_type_name(base),
                                 sfx, N, K, M, S);
                        const std::vector<float> g = check_split_run(
                            what, [&] { CK(m40k_gemm_q(dw, type, N, K, dx, xs, M, dy, ldy, S, dws, dcnt, 0)); }, dy, c,
                            M, N, ldy, (float)(2e-6 * mag), 1e-4f, dcnt, m40k_gemm_q_counter_ints(N, M));
                        const int kind = m40k_gemm_q_kernel(type, K, M, dw);
                        check("gemm_q kernel named", kind == M40K_GEMM_Q_DIRECT || kind == M40K_GEMM_Q_STAGED ||
                                                         kind == M40K_GEMM_Q_REGISTER);
                        if (kind == M40K_GEMM_Q_REGISTER && S == pick)
                            for (int R : {96, 112, 128}) { /* each block size the pick may take */
                                m40k_gemm_q_rows(R);
                                snprintf(what, sizeof what, "gemm_q %s%s N %d K %d M %d splits %d rows %d",
                                         m40_type_name(base), sfx, N, K, M, S, R);
                                check_split_run(
                                    what, [&] { CK(m40k_gemm_q(dw, type, N, K, dx, xs, M, dy, ldy, S, dws, dcnt, 0)); },
                                    dy, c, M, N, ldy, (float)(2e-6 * mag), 1e-4f, dcnt,
                                    m40k_gemm_q_counter_ints(N, M));
                                m40k_gemm_q_rows(0);
                            }
                        if (S == pick && (N == 17 || M == 33)) {
                            /* W 2 bytes off 16-byte alignment: the direct kernel (byte loads);
                             * the same steps and sums as the staged one, so the same bits
                             * (the register kernel sums in another order: the twin's bound) */
                            uint8_t *dw2;
                            CK(cudaMalloc(&dw2, wd.size() + 64));
                            CK(cudaMemcpy(dw2 + 2, wd.data(), wd.size(), cudaMemcpyHostToDevice));
                            CK(m40k_gemm_q(dw2 + 2, type, N, K, dx, xs, M, dy, ldy, S, dws, dcnt, 0));
                            std::vector<float> g3 = back(dy, c.size());
                            check("gemm_q W+2 takes the direct kernel",
                                  m40k_gemm_q_kernel(type, K, M, dw2 + 2) == M40K_GEMM_Q_DIRECT);
                            if (kind == M40K_GEMM_Q_REGISTER) {
                                for (int t = 0; t < M; t++)
                                    for (int64_t r = N; r < ldy; r++)
                                        g3[(size_t)t * ldy + r] = 0.0f;
                                snprintf(what, sizeof what, "gemm_q %s%s N %d K %d M %d splits %d: W+2 (direct)",
                                         m40_type_name(base), sfx, N, K, M, S);
                                compare(what, g3.data(), c.data(), c.size(), (float)(2e-6 * mag), 1e-4f);
                            } else {
                                bool same3 = true;
                                for (int t = 0; t < M; t++)
                                    for (int r = 0; r < N; r++)
                                        same3 = same3 &&
                                                memcmp(&g3[(size_t)t * ldy + r], &g[(size_t)t * ldy + r], 4) == 0;
                                snprintf(what, sizeof what, "gemm_q %s%s N %d K %d M %d splits %d: W+2 same bits",
                                         m40_type_name(base), sfx, N, K, M, S);
                                check(what, same3);
                            }
                            cudaFree(dw2);
                        }
                    }
                    cudaFree(dw), cudaFree(dx), cudaFree(dy), cudaFree(dws), cudaFree(dcnt);
                }
        /* the dequantizer's blocks walk several tiles each (its grid is what fits at once:
         * 6757 rows x 8 chunks are 1,696 tiles), the last rows a partial tile */
        if (type == M40K_TYPE_Q4_K || type == M40K_TYPE_Q8_0_G8 || type == M40K_TYPE_Q6_K_G8 ||
            type == M40K_TYPE_Q4_0) {
            const int N = 32 * 211 + 5, K = 2048;
            std::vector<uint8_t> w = quant_matrix(base, N, K);
            uint8_t *dw = dup(dev_layout(type, w, N, K));
            check_dequant(type, base, sfx, w, dw, N, K);
            cudaFree(dw);
        }
    }
    /* refusals: K not a multiple of the type's block, x misaligned or strided oddly, a
     * type it does not read, splits past K/64 without a workspace */
    const void *pw = (const void *)16;
    const uint16_t *px = (const uint16_t *)16;
    float *py = (float *)16;
    check("gemm_q refuses Q4_K K 288", m40k_gemm_q(pw, M40K_TYPE_Q4_K, 4, 288, px, 288, 9, py, 4, 1, NULL, NULL, 0) != 0);
    check("gemm_q refuses x + 2", m40k_gemm_q(pw, M40K_TYPE_Q8_0, 4, 64, px + 1, 64, 9, py, 4, 1, NULL, NULL, 0) != 0);
    check("gemm_q refuses x_stride 68", m40k_gemm_q(pw, M40K_TYPE_Q8_0, 4, 64, px, 68, 9, py, 4, 1, NULL, NULL, 0) != 0);
    check("gemm_q refuses F32", m40k_gemm_q(pw, M40K_TYPE_F32, 4, 64, px, 64, 9, py, 4, 1, NULL, NULL, 0) != 0);
    check("gemm_q refuses 2 splits of K 256",
          m40k_gemm_q(pw, M40K_TYPE_Q8_0, 4, 256, px, 256, 9, py, 4, 2, py, (int *)16, 0) != 0);
    check("gemm_q refuses splits without workspace",
          m40k_gemm_q(pw, M40K_TYPE_Q8_0, 4, 512, px, 512, 9, py, 4, 2, NULL, NULL, 0) != 0);
    check("gemm_q supports Q4_K, not F32", m40k_gemm_q_supported(M40K_TYPE_Q4_K) && !m40k_gemm_q_supported(M40K_TYPE_F32));
}

/* m40k_f32_to_f16 (model_aux.h) against the CPU's rounding (m40_fp32_to_fp16), bit for
 * bit: values across F16's range, past it, subnormal and infinite; lengths and offsets
 * that take the four-a-thread kernel and those that do not. */
static void test_f32_to_f16(void)
{
    const std::vector<int64_t> ns = {1, 3, 4, 1001, 4096, (int64_t)4096 * 512 + 4};
    for (int64_t n : ns)
        for (int off : {0, 1}) {
            std::vector<float> x = rand_vec((size_t)n + 1, -1, 1);
            for (size_t i = 0; i < x.size(); i++) {
                const float e = (float)ldexp(1.0, (int)(i % 41) - 26); /* 2^-26 .. 2^14 */
                x[i] *= i % 7 == 3 ? 1e5f : e;
            }
            x[n / 2] = INFINITY;
            x[n / 3] = -INFINITY;
            float *dx = dup(x);
            uint16_t *dy;
            CK(cudaMalloc(&dy, (size_t)(n + 1) * 2));
            CK(m40k_f32_to_f16(dx + off, dy + off, n, 0));
            std::vector<uint16_t> y = back(dy, (size_t)n + 1);
            size_t bad = 0;
            for (int64_t i = 0; i < n; i++)
                bad += y[(size_t)(i + off)] != m40_fp32_to_fp16(x[(size_t)(i + off)]);
            char what[96];
            snprintf(what, sizeof what, "f32_to_f16 n %lld offset %d: %zu differ", (long long)n, off, bad);
            check(what, bad == 0);
            cudaFree(dx), cudaFree(dy);
        }
}

/* 8f. The int8 tensor-core GEMM (m40k_quantize_x8, m40k_gemm_x8) against its twins: the
 * records byte for byte; the product within F32 summation of the twin's double sum;
 * and, so that a layout mistake shared by kernel and twin cannot pass, within the int8
 * rounding of x (a chunk's max|x| / 254 a weight) of the F16 product m40_ref_gemm_q. Q4_K and the
 * regrouped Q8_0_G8; N past the 128-row block; M in each tile height and odd; x rows
 * strided; split counts 1, picked and the most; same bits again; counters zero. */
static void test_gemm_x8(void)
{
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    for (int type : {M40K_TYPE_Q4_K, M40K_TYPE_Q8_0_G8}) {
        const int base = type == M40K_TYPE_Q8_0_G8 ? M40K_TYPE_Q8_0 : type;
        for (int K : {256, 1280, 4096})
            for (int N : {17, 259})
                for (int M : {1, 3, 9, 16, 27, 33, 64}) {
                    if (K == 4096 && N == 17 && M != 64 && M != 3)
                        continue;
                    const int64_t xs = K + 8, ldy = N + 3;
                    std::vector<uint8_t> w = quant_matrix(base, N, K), wd = w;
                    if (type != base)
                        CK(m40k_repack_g8(base, w.data(), wd.data(), N, K));
                    std::vector<float> xf = rand_vec((size_t)M * xs);
                    std::vector<uint16_t> x(xf.size());
                    for (size_t i = 0; i < xf.size(); i++)
                        x[i] = m40_fp32_to_fp16(xf[i] * (i % 97 == 5 ? 30.0f : 1.0f)); /* some large values */
                    const size_t xb = m40k_x8_bytes(K, M);
                    std::vector<uint8_t> rq(xb);
                    m40_ref_quantize_x8(x.data(), xs, K, M, rq.data());
                    uint16_t *dx = dup(x);
                    uint8_t *dq;
                    CK(cudaMalloc(&dq, xb));
                    CK(cudaMemset(dq, 0x5A, xb));
                    CK(m40k_quantize_x8(dx, xs, K, M, dq, 0));
                    char what[160];
                    snprintf(what, sizeof what, "quantize_x8 K %d M %d: records", K, M);
                    check(what, back(dq, xb) == rq);
                    std::vector<float> c((size_t)M * ldy, 0.0f), f((size_t)M * ldy, 0.0f);
                    m40_ref_gemm_x8(w.data(), base, N, K, rq.data(), M, c.data(), ldy);
                    m40_ref_gemm_q(w.data(), base, N, K, x.data(), xs, M, f.data(), ldy);
                    /* per output: sum over chunks of dx/2 * sum |w| (the most x's rounding can
                     * move it), plus 2^-9 of sum |w||x| (the F16 product's weights) and, for
                     * Q4_K, 2^-10 of sum |dmin m||x| (the F16 minimums and block sums: the
                     * minimum terms alone, -dmin m, are the weights with every level zeroed) */
                    const uint8_t *rrec = rq.data() + (size_t)M * K;
                    std::vector<uint8_t> w0 = w;
                    if (base == M40K_TYPE_Q4_K)
                        for (size_t sb = 0; sb < w0.size(); sb += 144)
                            memset(&w0[sb + 16], 0, 128);
                    std::vector<float> wr((size_t)K), wm((size_t)K, 0.0f);
                    std::vector<double> tol(c.size(), 0.0);
                    double mag = 0, xmax = 0; /* max over rows of sum_k |w|; max |x| */
                    for (uint16_t h : x)
                        xmax = std::max(xmax, (double)fabsf(m40_fp16_to_fp32(h)));
                    for (int r = 0; r < N; r++) {
                        m40_dequantize_row((uint32_t)base, w.data() + (size_t)r * row_bytes(base, K), wr.data(), K);
                        if (base == M40K_TYPE_Q4_K)
                            m40_dequantize_row((uint32_t)base, w0.data() + (size_t)r * row_bytes(base, K), wm.data(),
                                               K);
                        double m = 0;
                        for (int k = 0; k < K; k++)
                            m += fabs(wr[k]);
                        mag = std::max(mag, m);
                        for (int t = 0; t < M; t++) {
                            double e = 0, wx = 0, mx = 0;
                            for (int k = 0; k < K; k++) {
                                float dxc;
                                memcpy(&dxc, rrec + ((size_t)t * (K / 256) + k / 256) * 32, 4);
                                const double ax = fabsf(m40_fp16_to_fp32(x[(size_t)t * xs + k]));
                                e += fabs(wr[k]) * dxc / 2;
                                wx += fabs(wr[k]) * ax;
                                mx += fabs(wm[k]) * ax;
                            }
                            tol[(size_t)t * ldy + r] = e + wx / 512 + mx / 1024 + 1e-6;
                        }
                    }
                    size_t far = 0;
                    for (size_t i = 0; i < c.size(); i++)
                        far += !(fabs((double)c[i] - f[i]) <= tol[i]);
                    snprintf(what, sizeof what,
                             "gemm_x8 twin %s N %d K %d M %d: %zu outside x's rounding of the F16 product",
                             m40_type_name(type), N, K, M, far);
                    check(what, far == 0);
                    uint8_t *dw = dup(wd);
                    float *dy, *dws;
                    const int maxS = K / 256;
                    CK(cudaMalloc(&dy, c.size() * 4));
                    CK(cudaMalloc(&dws, m40k_gemm_q_ws_floats(N, M, maxS) * 4 + 16));
                    int *dcnt = dup(std::vector<int>(m40k_gemm_q_counter_ints(N, M), 0));
                    check("gemm_x8 reads it", m40k_gemm_x8_reads(type, K, M, dw) != 0);
                    const int pick = m40k_gemm_x8_pick_splits(type, N, K, M, sms);
                    check("gemm_x8 pick in 1..K/256", pick >= 1 && pick <= maxS);
                    for (int S : {1, pick, maxS}) {
                        snprintf(what, sizeof what, "gemm_x8 %s N %d K %d M %d splits %d", m40_type_name(type), N, K,
                                 M, S);
                        check_split_run(
                            what, [&] { CK(m40k_gemm_x8(dw, type, N, K, dq, M, dy, ldy, S, dws, dcnt, 0)); }, dy, c, M,
                            N, ldy, (float)(1e-5 * mag * xmax), 1e-4f, dcnt, m40k_gemm_q_counter_ints(N, M));
                    }
                    cudaFree(dw), cudaFree(dx), cudaFree(dq), cudaFree(dy), cudaFree(dws), cudaFree(dcnt);
                }
    }
    const void *pw = (const void *)16;
    float *py = (float *)16;
    check("gemm_x8 refuses Q6_K_G8", !m40k_gemm_x8_reads(M40K_TYPE_Q6_K_G8, 2048, 16, pw));
    check("gemm_x8 refuses K 288", m40k_gemm_x8(pw, M40K_TYPE_Q4_K, 4, 288, pw, 9, py, 4, 1, NULL, NULL, 0) != 0);
    check("gemm_x8 refuses M 65", m40k_gemm_x8(pw, M40K_TYPE_Q4_K, 4, 256, pw, 65, py, 4, 1, NULL, NULL, 0) != 0);
    check("gemm_x8 refuses W + 8", m40k_gemm_x8((const uint8_t *)pw + 8, M40K_TYPE_Q4_K, 4, 256, pw, 9, py, 4, 1, NULL,
                                                NULL, 0) != 0);
    check("gemm_x8 refuses splits without workspace",
          m40k_gemm_x8(pw, M40K_TYPE_Q4_K, 4, 512, pw, 9, py, 4, 2, NULL, NULL, 0) != 0);
    check("quantize_x8 refuses K 96", m40k_quantize_x8((const uint16_t *)pw, 96, 96, 1, (void *)py, 0) != 0);
}

/* 8c'. m40k_gemm_skinny_glu (the down projection fed by the gate/up product) against
 * its twin: this GPU's m40k_glu output rounded to F16, then m40_ref_gemv (only the order
 * of the sum differs; the GLU itself is compared with m40_ref_glu in test_act). Both
 * activations, gate and up rows of one strided buffer (up K floats after gate, as the
 * model lays them out), batch rows 1..8, N past the 128-row block, split counts 1, picked
 * and the most; the counters back at zero. Refusals: an unknown activation, a misaligned
 * up row. */
static void test_gemm_skinny_glu(void)
{
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    for (int act : {M40K_GLU_SILU, M40K_GLU_GELU_TANH})
        for (int K : {128, 1152, 4096 + 128})
            for (int N : {17, 259})
                for (int n : {1, 3, 8}) {
                    const int64_t is = 2 * (int64_t)K + 4, ldy = N + 1;
                    std::vector<float> wf = rand_vec((size_t)N * K), in = rand_vec((size_t)n * is, -4, 4);
                    std::vector<uint16_t> w(wf.size());
                    for (size_t i = 0; i < wf.size(); i++)
                        w[i] = m40_fp32_to_fp16(wf[i]);
                    float *din = dup(in), *dh, *dy, *dws;
                    CK(cudaMalloc(&dh, (size_t)n * K * 4));
                    CK(m40k_glu(act, din, din + K, is, dh, K, n, K, 0));
                    std::vector<float> h = back(dh, (size_t)n * K);
                    double hmax = 0, mag = 0;
                    for (float &v : h) {
                        v = m40_fp16_to_fp32(m40_fp32_to_fp16(v));
                        hmax = std::max(hmax, (double)fabsf(v));
                    }
                    for (int r = 0; r < N; r++) {
                        double m = 0;
                        for (int k = 0; k < K; k++)
                            m += fabs(m40_fp16_to_fp32(w[(size_t)r * K + k]));
                        mag = std::max(mag, m);
                    }
                    std::vector<float> c((size_t)n * ldy, 0.0f);
                    m40_ref_gemv(w.data(), M40K_TYPE_F16, N, K, h.data(), K, c.data(), ldy, n);
                    uint16_t *dw = dup(w);
                    const int maxS = K / 128;
                    CK(cudaMalloc(&dy, c.size() * 4));
                    CK(cudaMemset(dy, 0, c.size() * 4));
                    CK(cudaMalloc(&dws, m40k_gemm_skinny_ws_floats(N, n, maxS) * 4 + 16));
                    int *dcnt = dup(std::vector<int>(m40k_gemm_skinny_counter_ints(N), 0));
                    const int pick = m40k_gemm_skinny_pick_splits(N, K, n, sms, m40k_gemm_skinny_ws_floats(N, n, maxS),
                                                                  m40k_gemm_skinny_counter_ints(N));
                    for (int S : {1, pick, maxS}) {
                        CK(m40k_gemm_skinny_glu(act, dw, N, K, din, din + K, is, n, dy, ldy, S, dws, dcnt, 0));
                        std::vector<float> g = back(dy, c.size());
                        char what[112];
                        snprintf(what, sizeof what, "gemm_skinny_glu act %d N %d K %d n %d splits %d", act, N, K, n, S);
                        compare(what, g.data(), c.data(), c.size(), (float)(2e-6 * mag * std::max(hmax, 1.0)), 1e-4f);
                        std::vector<int> cnt = back(dcnt, m40k_gemm_skinny_counter_ints(N));
                        snprintf(what, sizeof what, "gemm_skinny_glu act %d N %d K %d n %d splits %d: counters zero",
                                 act, N, K, n, S);
                        check(what, std::all_of(cnt.begin(), cnt.end(), [](int v) { return v == 0; }));
                    }
                    cudaFree(dw), cudaFree(din), cudaFree(dh), cudaFree(dy), cudaFree(dws), cudaFree(dcnt);
                }
    const uint16_t *pw = (const uint16_t *)16;
    const float *px = (const float *)16;
    float *py = (float *)16;
    check("gemm_skinny_glu refuses activation 7",
          m40k_gemm_skinny_glu(7, pw, 4, 128, px, px + 128, 256, 1, py, 4, 1, NULL, NULL, 0) != 0);
    check("gemm_skinny_glu refuses a misaligned up row",
          m40k_gemm_skinny_glu(M40K_GLU_SILU, pw, 4, 128, px, px + 129, 260, 1, py, 4, 1, NULL, NULL, 0) != 0);
}

/* 8b. int8-activation GEMV (m40k_quantize_q8 + m40k_gemv_q8) against its twin
 * (m40_ref_quantize_q8 / m40_ref_gemv_q8: same workspace bytes, same integer dots, so a
 * tight tolerance) and against the exact F32 m40_ref_gemv with the documented bound of
 * the two-level activations, sum_k |W[n][k]| * max|x of k's block| / 254^2 * (1 + 2^-14).
 * Batch rows b: 0 mod 4 uniform, 1 with
 * zero blocks and zero elements, 2 blocks scaled by 1e20 / 1e-20 / 1, 3 one large
 * element per block among tiny ones; row 4 (batch >= 5) all zero. */
static const int q8_types[] = {M40K_TYPE_Q8_0, M40K_TYPE_Q4_0, M40K_TYPE_Q4_K, M40K_TYPE_Q6_K};

static std::vector<float> q8_x(int batch, int K, int64_t xs)
{
    std::vector<float> x = rand_vec(batch * xs);
    for (int b = 0; b < batch; b++)
        for (int k = 0; k < K; k++) {
            float &v = x[b * xs + k];
            const int blk = k / 32;
            if (b == 4)
                v = 0.0f;
            else if (b % 4 == 1 && (blk % 3 == 1 || k % 7 == 3))
                v = 0.0f;
            else if (b % 4 == 2)
                v *= blk % 3 == 0 ? 1e20f : blk % 3 == 1 ? 1e-20f : 1.0f;
            else if (b % 4 == 3)
                v *= k % 32 == blk % 32 ? 1e3f : 1e-3f;
        }
    return x;
}

static void compare_bound(const char *what, const float *g, const float *c, const double *tol, size_t n)
{
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; i++)
        if (!(fabs((double)g[i] - c[i]) <= tol[i]) && !bad++)
            first = i;
    if (bad) {
        n_fail++;
        printf("FAIL %s: %zu/%zu differ, first [%zu] gpu %g ref %g (tolerance %g)\n", what, bad, n, first, g[first],
               c[first], tol[first]);
    } else {
        n_pass++;
    }
}

static void test_gemv_q8(void)
{
    const int Ns[] = {1, 7, 33, 4097};
    for (int type : q8_types) {
        const bool kq = type == M40K_TYPE_Q4_K || type == M40K_TYPE_Q6_K;
        const std::vector<int> Ks = kq ? std::vector<int>{256, 768, 4096, 14336}
                                       : std::vector<int>{32, 96, 608, 4096, 14336};
        for (int K : Ks)
            for (int N : Ns) {
                if ((double)N * K > 4097.0 * 4096)
                    continue;
                std::vector<uint8_t> w = quant_matrix(type, N, K);
                std::vector<float> deq((size_t)N * K);
                for (int n = 0; n < N; n++)
                    m40_dequantize_row((uint32_t)type, w.data() + n * row_bytes(type, K), deq.data() + (size_t)n * K,
                                       K);
                uint8_t *dw = dup(w), *dw8 = nullptr;
                const int g8 = m40k_g8_type(type, K);
                if (g8 != type) {
                    std::vector<uint8_t> w8(w.size());
                    CK(m40k_repack_g8(type, w.data(), w8.data(), N, K));
                    dw8 = dup(w8);
                }
                for (int batch = 1; batch <= 8; batch++) {
                    if ((double)N * K * batch > 5e6 && batch != 1 && batch != 8)
                        continue;
                    const int64_t xs = K + 4, ys = N + 1;
                    std::vector<float> x = q8_x(batch, K, xs);
                    const size_t wsb = m40k_gemv_q8_ws_bytes(K, batch);
                    std::vector<uint8_t> ws(wsb);
                    std::vector<float> c(batch * ys, 0.0f), e(batch * ys, 0.0f);
                    m40_ref_quantize_q8(x.data(), xs, K, batch, ws.data());
                    m40_ref_gemv_q8(w.data(), type, N, K, ws.data(), batch, c.data(), ys);
                    m40_ref_gemv(w.data(), type, N, K, x.data(), xs, e.data(), ys, batch);
                    /* per output: m = sum (|w| + |o|)(|x| + amax/254^2) bounds every term,
                     * o the offset the kernel subtracts separately (Q4_0: w = d q - 8 d, so
                     * a zero weight still adds 8 d x and takes it away again: with one
                     * large x, float rounding of that pair shows); q = the activation-
                     * quantization bound sum |w| amax/254^2 (1 + 2^-14) */
                    std::vector<double> tt(c.size(), 0.0), te(c.size(), 0.0);
                    std::vector<float> amax(K / 32);
                    for (int b = 0; b < batch; b++) {
                        for (int j = 0; j < K / 32; j++) {
                            amax[j] = 0.0f;
                            for (int i = 0; i < 32; i++)
                                amax[j] = std::max(amax[j], fabsf(x[b * xs + 32 * j + i]));
                        }
                        for (int n = 0; n < N; n++) {
                            double m = 0, q = 0;
                            for (int k = 0; k < K; k++) {
                                const double aw = fabs(deq[(size_t)n * K + k]), ab = amax[k / 32] / (254.0 * 254.0);
                                double ao = 0.0;
                                if (type == M40K_TYPE_Q4_0) {
                                    const uint8_t *blk = w.data() + n * row_bytes(type, K) + 18 * (k / 32);
                                    ao = 8.0 * fabs(m40_fp16_to_fp32((uint16_t)(blk[0] | blk[1] << 8)));
                                }
                                m += (aw + ao) * (fabs(x[b * xs + k]) + ab);
                                q += aw * ab;
                            }
                            tt[b * ys + n] = 1e-5 * m;
                            te[b * ys + n] = q * (1 + 1.0 / 16384) + 1e-5 * m;
                        }
                    }
                    float *dx = dup(x), *dy;
                    void *dws;
                    CK(cudaMalloc(&dws, wsb));
                    CK(cudaMalloc(&dy, c.size() * 4));
                    CK(cudaMemset(dy, 0, c.size() * 4));
                    CK(m40k_quantize_q8(dx, xs, K, batch, dws, 0));
                    CK(m40k_gemv_q8(dw, type, N, K, dws, batch, dy, ys, 0));
                    std::vector<uint8_t> gws = back((uint8_t *)dws, wsb);
                    std::vector<float> g = back(dy, c.size());
                    char what[112];
                    snprintf(what, sizeof what, "quantize_q8 K %d batch %d: bytes equal the twin's", K, batch);
                    check(what, gws == ws);
                    snprintf(what, sizeof what, "gemv_q8 %s N %d K %d batch %d vs twin", m40_type_name(type), N, K,
                             batch);
                    compare_bound(what, g.data(), c.data(), tt.data(), c.size());
                    snprintf(what, sizeof what, "gemv_q8 %s N %d K %d batch %d vs exact", m40_type_name(type), N, K,
                             batch);
                    compare_bound(what, g.data(), e.data(), te.data(), c.size());
                    /* the same weights regrouped (kernels.h 0.), where K allows: the same
                     * products within the same bound of the twin */
                    if (dw8) {
                        CK(cudaMemset(dy, 0, c.size() * 4));
                        CK(m40k_gemv_q8(dw8, g8, N, K, dws, batch, dy, ys, 0));
                        std::vector<float> g2 = back(dy, c.size());
                        snprintf(what, sizeof what, "gemv_q8 %s_G8 N %d K %d batch %d vs twin", m40_type_name(type),
                                 N, K, batch);
                        compare_bound(what, g2.data(), c.data(), tt.data(), c.size());
                    }
                    cudaFree(dx), cudaFree(dy), cudaFree(dws);
                }
                cudaFree(dw);
                if (dw8)
                    cudaFree(dw8);
            }
        /* W not 16-byte aligned: refused (the caller takes m40k_gemv) */
        uint8_t *dw;
        void *dws;
        float *dy;
        CK(cudaMalloc(&dw, 4096));
        CK(cudaMalloc(&dws, 4096));
        CK(cudaMalloc(&dy, 64));
        char what[64];
        snprintf(what, sizeof what, "gemv_q8 %s W+2 refused", m40_type_name(type));
        check(what, m40k_gemv_q8(dw + 2, type, 1, 256, dws, 1, dy, 1, 0) == (int)cudaErrorInvalidValue);
        cudaFree(dw), cudaFree(dws), cudaFree(dy);
    }
    /* regrouped layouts: only where whole groups fit a row */
    const int bad = (int)cudaErrorInvalidValue;
    check("g8 types: Q8_0 K 256 -> Q8_0_G8, K 96 none; Q6_K K 2048 -> Q6_K_G8, K 768 none; Q4_K none",
          m40k_g8_type(M40K_TYPE_Q8_0, 256) == M40K_TYPE_Q8_0_G8 &&
              m40k_g8_type(M40K_TYPE_Q8_0, 96) == M40K_TYPE_Q8_0 &&
              m40k_g8_type(M40K_TYPE_Q6_K, 2048) == M40K_TYPE_Q6_K_G8 &&
              m40k_g8_type(M40K_TYPE_Q6_K, 768) == M40K_TYPE_Q6_K &&
              m40k_g8_type(M40K_TYPE_Q4_K, 4096) == M40K_TYPE_Q4_K);
    uint8_t hb[64];
    check("repack_g8 refuses a type or K without a layout",
          m40k_repack_g8(M40K_TYPE_Q4_K, hb, hb + 32, 1, 256) == bad &&
              m40k_repack_g8(M40K_TYPE_Q6_K, hb, hb + 32, 1, 256) == bad);
    {
        /* Q6_K_P: each 210-byte superblock, then 14 zero bytes; K not a multiple of 256 refused */
        std::vector<uint8_t> q(2 * 3 * 210), p(2 * 3 * 224, 0xAB);
        for (auto &v : q)
            v = (uint8_t)rnd32();
        bool same = m40k_repack_q6_k_p(q.data(), p.data(), 2, 768) == 0;
        for (int b = 0; b < 6; b++)
            for (int i = 0; i < 224; i++)
                same = same && p[(size_t)224 * b + i] == (i < 210 ? q[(size_t)210 * b + i] : 0);
        check("repack_q6_k_p: 2 rows of 768, superblocks padded with zeros", same);
        check("repack_q6_k_p refuses K 100 and K 0", m40k_repack_q6_k_p(q.data(), p.data(), 1, 100) == bad &&
                                                          m40k_repack_q6_k_p(q.data(), p.data(), 1, 0) == bad);
    }
    uint8_t *dw;
    void *dws;
    float *dy;
    CK(cudaMalloc(&dw, 1 << 16));
    CK(cudaMalloc(&dws, 1 << 16));
    CK(cudaMalloc(&dy, 64));
    check("gemv_q8 Q6_K_G8 K 1024 refused", m40k_gemv_q8(dw, M40K_TYPE_Q6_K_G8, 1, 1024, dws, 1, dy, 1, 0) == bad);
    check("gemv_q8 Q8_0_G8 K 96 refused", m40k_gemv_q8(dw, M40K_TYPE_Q8_0_G8, 1, 96, dws, 1, dy, 1, 0) == bad);
    cudaFree(dw), cudaFree(dws), cudaFree(dy);
}

/* 8b'. Two products in one launch (m40k_gemv_q8_pair: Q4_K then Q6_K, batch 1) against
 * the twin of each product, with the tolerance of test_gemv_q8's twin check; the pair
 * kernel's rows must land at y[0, N0) and y[N0, N0 + N1) and nowhere else. Other type
 * pairs and batches are refused. */
static void test_gemv_q8_pair(void)
{
    const int shapes[][3] = {{1, 1, 256},         {33, 7, 768},       {7, 33, 256},
                             {5120, 1024, 4096}, {4097, 31, 4096}, {9, 5, 2048}};
    for (const auto &sh : shapes) {
        for (int regroup = 0; regroup < 2; regroup++) { /* Q6_K as in the file, then regrouped */
            const int N0 = sh[0], N1 = sh[1], K = sh[2];
            const int t0 = M40K_TYPE_Q4_K, t1 = M40K_TYPE_Q6_K, t1d = regroup ? m40k_g8_type(t1, K) : t1;
            if (regroup && t1d == t1)
                continue;
            std::vector<uint8_t> w0 = quant_matrix(t0, N0, K), w1 = quant_matrix(t1, N1, K);
            std::vector<float> x = q8_x(1, K, K);
            const size_t wsb = m40k_gemv_q8_ws_bytes(K, 1);
            std::vector<uint8_t> ws(wsb);
            m40_ref_quantize_q8(x.data(), K, K, 1, ws.data());
            const int ny = N0 + N1 + 5; /* 5 guard entries past the products */
            std::vector<float> c(ny, -7.0f);
            m40_ref_gemv_q8(w0.data(), t0, N0, K, ws.data(), 1, c.data(), ny);
            m40_ref_gemv_q8(w1.data(), t1, N1, K, ws.data(), 1, c.data() + N0, ny);
            std::vector<double> tt(ny, 0.0);
            for (int n = 0; n < N0 + N1; n++) {
                const bool first = n < N0;
                const std::vector<uint8_t> &w = first ? w0 : w1;
                const int type = first ? t0 : t1, row = first ? n : n - N0;
                std::vector<float> deq(K);
                m40_dequantize_row((uint32_t)type, w.data() + (size_t)row * row_bytes(type, K), deq.data(), K);
                double m = 0;
                for (int k = 0; k < K; k++)
                    m += fabs(deq[k]) * (fabs(x[k]) + 1.0);
                tt[n] = 1e-5 * m;
            }
            std::vector<uint8_t> w1d = w1;
            if (regroup)
                CK(m40k_repack_g8(t1, w1.data(), w1d.data(), N1, K));
            uint8_t *dw0 = dup(w0), *dw1 = dup(w1d);
            float *dx = dup(x), *dy;
            void *dws;
            CK(cudaMalloc(&dws, wsb));
            CK(cudaMalloc(&dy, ny * 4));
            std::vector<float> fill(ny, -7.0f);
            CK(cudaMemcpy(dy, fill.data(), ny * 4, cudaMemcpyHostToDevice));
            CK(m40k_quantize_q8(dx, K, K, 1, dws, 0));
            CK(m40k_gemv_q8_pair(dw0, t0, N0, dw1, t1d, N1, K, dws, 1, dy, ny, 0));
            std::vector<float> g = back(dy, ny);
            char what[112];
            snprintf(what, sizeof what, "gemv_q8_pair Q4_K %d + Q6_K%s %d, K %d vs twins", N0, regroup ? "_G8" : "",
                     N1, K);
            compare_bound(what, g.data(), c.data(), tt.data(), (size_t)(N0 + N1));
            snprintf(what, sizeof what, "gemv_q8_pair %d + %d, K %d: nothing written past the products", N0, N1, K);
            check(what, g[N0 + N1] == -7.0f && g[ny - 1] == -7.0f);
            cudaFree(dw0), cudaFree(dw1), cudaFree(dx), cudaFree(dy), cudaFree(dws);
        }
    }
    uint8_t *dw;
    void *dws;
    float *dy;
    CK(cudaMalloc(&dw, 1 << 16));
    CK(cudaMalloc(&dws, 4096));
    CK(cudaMalloc(&dy, 256));
    const int bad = (int)cudaErrorInvalidValue;
    check("gemv_q8_pair Q6_K + Q4_K refused",
          m40k_gemv_q8_pair(dw, M40K_TYPE_Q6_K, 1, dw, M40K_TYPE_Q4_K, 1, 256, dws, 1, dy, 2, 0) == bad);
    check("gemv_q8_pair Q8_0 + Q8_0 refused",
          m40k_gemv_q8_pair(dw, M40K_TYPE_Q8_0, 1, dw, M40K_TYPE_Q8_0, 1, 256, dws, 1, dy, 2, 0) == bad);
    check("gemv_q8_pair batch 2 refused",
          m40k_gemv_q8_pair(dw, M40K_TYPE_Q4_K, 1, dw, M40K_TYPE_Q6_K, 1, 256, dws, 2, dy, 2, 0) == bad);
    check("gemv_q8_pair Q4_K + Q6_K_G8 K 1024 refused",
          m40k_gemv_q8_pair(dw, M40K_TYPE_Q4_K, 1, dw, M40K_TYPE_Q6_K_G8, 1, 1024, dws, 1, dy, 2, 0) == bad);
    check("gemv_q8_pair K 255 refused",
          m40k_gemv_q8_pair(dw, M40K_TYPE_Q4_K, 1, dw, M40K_TYPE_Q6_K, 1, 255, dws, 1, dy, 2, 0) == bad);
    check("gemv_q8_pair W1+2 refused",
          m40k_gemv_q8_pair(dw, M40K_TYPE_Q4_K, 1, dw + 2, M40K_TYPE_Q6_K, 1, 256, dws, 1, dy, 2, 0) == bad);
    cudaFree(dw), cudaFree(dws), cudaFree(dy);
}

/* The device layout a test runs a GGUF type's matrix of width K in: the file's (regroup 0)
 * or its regrouped one of kernels.h 0. (regroup 1); -1 where that layout does not exist
 * or K does not take the type's blocks. */
static int q8_test_layout(int type, int K, int regroup)
{
    if (K % (type == M40K_TYPE_Q4_K || type == M40K_TYPE_Q6_K ? 256 : 32))
        return -1;
    const int dtype = regroup ? m40k_g8_type(type, K) : type;
    return regroup && dtype == type ? -1 : dtype;
}

/* w (rows x K of GGUF type `type`) as the device keeps it in layout dtype */
static std::vector<uint8_t> q8_in_layout(int type, int dtype, const std::vector<uint8_t> &w, int rows, int K)
{
    std::vector<uint8_t> wd = w;
    if (dtype != type)
        CK(m40k_repack_g8(type, w.data(), wd.data(), rows, K));
    return wd;
}

/* 8d. The RMSNorm folded into the int8 GEMVs (batch 1). Producer: x_out against the twin
 * within the GEMV's twin bound; its records byte for byte what the twin quantizer makes of
 * the GPU's own x_out * norm_w; its sums of squares against those of the GPU's x_out.
 * Consumer (single and pair): the twin's product times the twin's factor. GGUF types and
 * their regrouped layouts; in place (x_out == x) as well. */
static void test_gemv_q8_norm(void)
{
    const int shapes[][2] = {{32, 256}, {96, 2048}, {4096, 4096}, {4096, 14336}, {1024, 4096}};
    for (int type : q8_types)
        for (const auto &sh : shapes)
            for (int regroup = 0; regroup < 2; regroup++) {
                const int N = sh[0], K = sh[1], dtype = q8_test_layout(type, K, regroup);
                if (dtype < 0)
                    continue;
                const std::vector<uint8_t> w = quant_matrix(type, N, K), wd = q8_in_layout(type, dtype, w, N, K);
                std::vector<float> xin = q8_x(1, K, K), xres = rand_vec(N, -4, 4), wn = rand_vec(N, 0.5f, 1.5f);
                const size_t wsb = m40k_gemv_q8_ws_bytes(K, 1), wsn = m40k_gemv_q8_ws_bytes(N, 1);
                std::vector<uint8_t> ws(wsb);
                m40_ref_quantize_q8(xin.data(), K, K, 1, ws.data());
                std::vector<float> c(N), cb(N), css(N / 32), bias = rand_vec(N, -2, 2);
                std::vector<uint8_t> cq(wsn);
                m40_ref_gemv_q8_add_norm(w.data(), type, N, K, ws.data(), nullptr, xres.data(), c.data(), wn.data(),
                                         cq.data(), css.data());
                m40_ref_gemv_q8_add_norm(w.data(), type, N, K, ws.data(), bias.data(), xres.data(), cb.data(), wn.data(),
                                         cq.data(), css.data());
                /* the twin bound of test_gemv_q8, simplified: 1e-5 sum |w| (|x| + 1) */
                std::vector<double> tt(N);
                for (int n = 0; n < N; n++) {
                    std::vector<float> deq(K);
                    m40_dequantize_row((uint32_t)type, w.data() + (size_t)n * row_bytes(type, K), deq.data(), K);
                    double m = fabs(xres[n]);
                    for (int k = 0; k < K; k++)
                        m += fabs(deq[k]) * (fabs(xin[k]) + 1.0);
                    tt[n] = 1e-5 * m;
                }
                uint8_t *dw = dup(wd);
                float *dxr = dup(xres), *dwn = dup(wn), *db = dup(bias), *dxo, *dss, *dxi = dup(xin), *dy;
                void *dws, *dq;
                CK(cudaMalloc(&dws, wsb));
                CK(cudaMalloc(&dq, wsn));
                CK(cudaMalloc(&dxo, N * 4));
                CK(cudaMalloc(&dss, N / 32 * 4));
                CK(m40k_quantize_q8(dxi, K, K, 1, dws, 0));
                char what[128], tn[16];
                snprintf(tn, sizeof tn, "%s%s", m40_type_name(type), regroup ? "_G8" : "");
                /* variant 0: out of place, 1: in place, 2: out of place with a bias */
                for (int variant = 0; variant < 3; variant++) {
                    const int inplace = variant == 1, bi = variant == 2;
                    float *out = inplace ? dxr : dxo;
                    CK(m40k_gemv_q8_add_norm(dw, dtype, N, K, dws, bi ? db : nullptr, dxr, out, dwn, dq, dss, 0));
                    std::vector<float> g = back(out, N), gss = back(dss, N / 32);
                    std::vector<uint8_t> gq = back((uint8_t *)dq, wsn), rq(wsn);
                    if (inplace)
                        CK(cudaMemcpy(dxr, xres.data(), N * 4, cudaMemcpyHostToDevice));
                    snprintf(what, sizeof what, "gemv_q8_add_norm %s N %d K %d%s: x_out vs twin", tn, N, K,
                             inplace ? " in place" : bi ? " +bias" : "");
                    compare_bound(what, g.data(), bi ? cb.data() : c.data(), tt.data(), N);
                    std::vector<float> v(N);
                    for (int n = 0; n < N; n++)
                        v[n] = g[n] * wn[n];
                    m40_ref_quantize_q8(v.data(), N, N, 1, rq.data());
                    snprintf(what, sizeof what, "gemv_q8_add_norm %s N %d K %d%s: records of x_out*w", tn, N, K,
                             inplace ? " in place" : bi ? " +bias" : "");
                    check(what, gq == rq);
                    bool ok = true;
                    for (int j = 0; j < N / 32; j++) {
                        double s = 0;
                        for (int i = 0; i < 32; i++)
                            s += (double)g[32 * j + i] * g[32 * j + i];
                        ok &= fabs(gss[j] - s) <= 1e-5 * s + 1e-30;
                    }
                    snprintf(what, sizeof what, "gemv_q8_add_norm %s N %d K %d%s: sums of squares", tn, N, K,
                             inplace ? " in place" : bi ? " +bias" : "");
                    check(what, ok);
                }
                /* consumer: the records of xin and sums of squares of a vector of K */
                std::vector<float> sq(K / 32);
                for (auto &v : sq)
                    v = 0.5f + 31.0f * (float)(rnd32() % 1000) / 1000.0f;
                const float eps = 1e-5f, f = m40_ref_norm_factor(sq.data(), K, eps);
                float *dsq = dup(sq);
                const int ny = N + 3;
                CK(cudaMalloc(&dy, ny * 4));
                std::vector<float> cy(N), fill(ny, -7.0f);
                m40_ref_gemv_q8(w.data(), type, N, K, ws.data(), 1, cy.data(), N);
                std::vector<double> ft(N);
                for (int n = 0; n < N; n++)
                    cy[n] *= f, ft[n] = f * tt[n] + 1e-6 * fabs(cy[n]);
                CK(cudaMemcpy(dy, fill.data(), ny * 4, cudaMemcpyHostToDevice));
                CK(m40k_gemv_q8_normed(dw, dtype, N, K, dws, dsq, eps, dy, N, 0));
                std::vector<float> gy = back(dy, ny);
                snprintf(what, sizeof what, "gemv_q8_normed %s N %d K %d vs twin x factor", tn, N, K);
                compare_bound(what, gy.data(), cy.data(), ft.data(), N);
                check("gemv_q8_normed: nothing past y", gy[N] == -7.0f);
                if (type == M40K_TYPE_Q6_K && N >= 64) { /* pair: Q4_K [N/2 rows] + this */
                    const int N0 = N / 2;
                    std::vector<uint8_t> w0 = quant_matrix(M40K_TYPE_Q4_K, N0, K);
                    std::vector<float> c0(N0 + N);
                    m40_ref_gemv_q8(w0.data(), M40K_TYPE_Q4_K, N0, K, ws.data(), 1, c0.data(), N0 + N);
                    std::vector<double> t0(N0 + N);
                    for (int n = 0; n < N0; n++) {
                        std::vector<float> deq(K);
                        m40_dequantize_row(M40K_TYPE_Q4_K, w0.data() + (size_t)n * row_bytes(M40K_TYPE_Q4_K, K),
                                           deq.data(), K);
                        double m = 0;
                        for (int k = 0; k < K; k++)
                            m += fabs(deq[k]) * (fabs(xin[k]) + 1.0);
                        c0[n] *= f;
                        t0[n] = f * 1e-5 * m + 1e-6 * fabs(c0[n]);
                    }
                    for (int n = 0; n < N; n++)
                        c0[N0 + n] = cy[n], t0[N0 + n] = ft[n];
                    uint8_t *dw0 = dup(w0);
                    float *dy2;
                    CK(cudaMalloc(&dy2, (N0 + N) * 4));
                    CK(m40k_gemv_q8_pair_normed(dw0, M40K_TYPE_Q4_K, N0, dw, dtype, N, K, dws, dsq, eps, dy2, N0 + N,
                                                0));
                    std::vector<float> g2 = back(dy2, N0 + N);
                    snprintf(what, sizeof what, "gemv_q8_pair_normed Q4_K %d + %s %d K %d vs twins x factor", N0, tn, N,
                             K);
                    compare_bound(what, g2.data(), c0.data(), t0.data(), N0 + N);
                    cudaFree(dw0), cudaFree(dy2);
                }
                cudaFree(dw), cudaFree(dxr), cudaFree(dwn), cudaFree(db), cudaFree(dxo), cudaFree(dss), cudaFree(dxi);
                cudaFree(dws), cudaFree(dq), cudaFree(dsq), cudaFree(dy);
            }
    /* refusals */
    uint8_t *dw;
    float *df;
    CK(cudaMalloc(&dw, 1 << 16));
    CK(cudaMalloc(&df, 1 << 16));
    const int bad = (int)cudaErrorInvalidValue;
    check("gemv_q8_add_norm N 33 refused",
          m40k_gemv_q8_add_norm(dw, M40K_TYPE_Q8_0, 33, 256, dw, nullptr, df, df, df, dw + 4096, df, 0) == bad);
    check("gemv_q8_add_norm xq_out == ws refused",
          m40k_gemv_q8_add_norm(dw, M40K_TYPE_Q8_0, 32, 256, dw + 4096, nullptr, df, df, df, dw + 4096, df, 0) == bad);
    check("gemv_q8_normed without ss refused",
          m40k_gemv_q8_normed(dw, M40K_TYPE_Q8_0, 32, 256, dw + 4096, nullptr, 1e-5f, df, 32, 0) == bad);
    check("gemv_q8_add_norm F16 refused",
          m40k_gemv_q8_add_norm(dw, M40K_TYPE_F16, 32, 256, dw + 4096, nullptr, df, df, df, dw + 8192, df, 0) == bad);
    cudaFree(dw), cudaFree(df);
}

/* 9c: the greedy pick folded into the head's int8 GEMV. Every int8 type (and the regrouped
 * layouts), a head's shape and odd ones, plain and normed: y bit for bit the GEMV's own,
 * and the key's id m40k_sample_greedy's pick of that y; then with the best row copied to a
 * lower id (a tie): the lower id. The key starts at 0, as the engine's table upload
 * leaves it. */
static int tie_id;
static void test_gemv_q8_argmax(void)
{
    const int shapes[][2] = {{32000, 4096}, {1001, 256}, {33, 2048}};
    for (int type : q8_types)
        for (const auto &sh : shapes)
            for (int regroup = 0; regroup < 2; regroup++) {
                const int N = sh[0], K = sh[1], dtype = q8_test_layout(type, K, regroup);
                if (dtype < 0)
                    continue;
                std::vector<uint8_t> w = quant_matrix(type, N, K);
                const size_t rb = row_bytes(type, K);
                std::vector<float> xin = q8_x(1, K, K), sq(K / 32);
                for (auto &v : sq)
                    v = 0.5f + 31.0f * (float)(rnd32() % 1000) / 1000.0f;
                float *dxi = dup(xin), *dsq = dup(sq), *dy, *dy2;
                void *dws;
                uint64_t *dkey;
                int32_t *dtok;
                float *dlp;
                CK(cudaMalloc(&dws, m40k_gemv_q8_ws_bytes(K, 1)));
                CK(cudaMalloc(&dy, N * 4));
                CK(cudaMalloc(&dy2, N * 4));
                CK(cudaMalloc(&dkey, 8));
                CK(cudaMalloc(&dtok, 4));
                CK(cudaMalloc(&dlp, 4));
                CK(m40k_quantize_q8(dxi, K, K, 1, dws, 0));
                for (int tie = 0; tie < 2; tie++)
                    for (int normed = 0; normed < 2; normed++) {
                        uint8_t *dw = dup(q8_in_layout(type, dtype, w, N, K));
                        CK(cudaMemset(dkey, 0, 8));
                        CK(m40k_gemv_q8_argmax(dw, dtype, N, K, dws, normed ? dsq : nullptr, 1e-5f, dy, dkey, 0));
                        if (normed)
                            CK(m40k_gemv_q8_normed(dw, dtype, N, K, dws, dsq, 1e-5f, dy2, N, 0));
                        else
                            CK(m40k_gemv_q8(dw, dtype, N, K, dws, 1, dy2, N, 0));
                        CK(m40k_sample_greedy(dy, N, 1, N, dtok, dlp, 0, nullptr, nullptr, 0));
                        const std::vector<uint64_t> key = back(dkey, 1);
                        const std::vector<int32_t> tok = back(dtok, 1);
                        char what[160];
                        snprintf(what, sizeof what, "gemv_q8_argmax %s%s N %d K %d %s%s: y == the GEMV's",
                                 m40_type_name(type), regroup ? "_G8" : "", N, K, normed ? "normed" : "plain",
                                 tie ? ", tie" : "");
                        check(what, back(dy, N) == back(dy2, N));
                        snprintf(what, sizeof what, "gemv_q8_argmax %s%s N %d K %d %s%s: id %d == sample_greedy's %d",
                                 m40_type_name(type), regroup ? "_G8" : "", N, K, normed ? "normed" : "plain",
                                 tie ? ", tie" : "", m40k_argmax_key_id(key[0]), tok[0]);
                        check(what, m40k_argmax_key_id(key[0]) == tok[0] && tok[0] >= 0);
                        if (tie) {
                            snprintf(what, sizeof what, "gemv_q8_argmax %s N %d: the tie goes to the lower id",
                                     m40_type_name(type), N);
                            check(what, tok[0] == tie_id);
                        }
                        cudaFree(dw);
                        if (!tie && normed && tok[0] > 0) { /* the best row copied to a lower id */
                            tie_id = tok[0] / 2;
                            memcpy(w.data() + (size_t)tie_id * rb, w.data() + (size_t)tok[0] * rb, rb);
                        } else if (!tie && normed) {
                            tie_id = 0; /* row 0 is the best: copying it lower is not possible */
                        }
                    }
                cudaFree(dxi), cudaFree(dsq), cudaFree(dy), cudaFree(dy2), cudaFree(dws), cudaFree(dkey);
                cudaFree(dtok), cudaFree(dlp);
            }
    uint8_t *dw;
    CK(cudaMalloc(&dw, 1 << 16));
    check("gemv_q8_argmax without a key refused",
          m40k_gemv_q8_argmax(dw, M40K_TYPE_Q8_0, 32, 256, dw + 4096, nullptr, 0.0f, (float *)(dw + 8192), nullptr,
                              0) == (int)cudaErrorInvalidValue);
    check("gemv_q8_argmax misaligned key refused",
          m40k_gemv_q8_argmax(dw, M40K_TYPE_Q8_0, 32, 256, dw + 4096, nullptr, 0.0f, (float *)(dw + 8192),
                              (uint64_t *)(dw + 12292), 0) == (int)cudaErrorInvalidValue);
    cudaFree(dw);
}

/* ---------------------------------------------------------------- 9. sampling */
static void test_sample(void)
{
    for (int vocab : {1, 17, 32000 + 17, 32768, 32769, 151936}) { /* one round of loads up to 32,768 */
        const int rows = 3, top_k = std::min(5, vocab);
        const int64_t st = vocab + 3;
        std::vector<float> l = rand_vec(rows * st, -10, 10);
        if (vocab > 100)
            l[1 * st + 5] = l[1 * st + 77] = 30.0f; /* a tie: lowest id wins */
        std::vector<int32_t> tok(rows), tt(rows * top_k);
        std::vector<float> lp(rows), tl(rows * top_k);
        m40_ref_sample_greedy(l.data(), st, rows, vocab, tok.data(), lp.data(), top_k, tt.data(), tl.data());
        float *dl = dup(l), *dlp, *dtl;
        int32_t *dtok, *dtt;
        CK(cudaMalloc(&dlp, rows * 4));
        CK(cudaMalloc(&dtl, rows * top_k * 4));
        CK(cudaMalloc(&dtok, rows * 4));
        CK(cudaMalloc(&dtt, rows * top_k * 4));
        CK(m40k_sample_greedy(dl, st, rows, vocab, dtok, dlp, top_k, dtt, dtl, 0));
        char what[64];
        snprintf(what, sizeof what, "sample vocab %d tokens", vocab);
        check(what, back(dtok, rows) == tok && back(dtt, rows * top_k) == tt);
        snprintf(what, sizeof what, "sample vocab %d logprobs", vocab);
        std::vector<float> g = back(dlp, rows), gt = back(dtl, rows * top_k);
        compare(what, g.data(), lp.data(), rows, 1e-4f, 1e-4f);
        compare(what, gt.data(), tl.data(), rows * top_k, 1e-4f, 1e-4f);
        cudaFree(dl), cudaFree(dlp), cudaFree(dtl), cudaFree(dtok), cudaFree(dtt);
    }
}

/* ---------------------------------------------------------------- bench */
static void bench_gemv(void)
{
    const double peak = 3020.0; /* GB/s, H100 80GB HBM3 copy bandwidth */
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("bench: %s, %d SMs; roofline %.0f GB/s (H100 copy bandwidth); W rotated over > 120 MB\n", prop.name,
           prop.multiProcessorCount, peak);
    struct { int N, K; } shapes[] = {{4096, 14336}, {14336, 4096}};
    for (auto sh : shapes)
        for (int type : gemv_types) {
            const size_t bytes = row_bytes(type, sh.K) * sh.N;
            std::vector<uint8_t> w(bytes);
            for (auto &b : w)
                b = (uint8_t)rnd32();
            if (type != M40K_TYPE_Q4_K) /* keep F16 values / scales finite: small exponents */
                for (size_t i = 1; i < bytes; i += 2)
                    w[i] &= 0x3B;
            /* copies of W taken in turn, together over 120 MB, so that W is not served from
             * the 50 MB L2 from one product to the next */
            const int copies = (int)(120000000 / bytes) + 1;
            std::vector<uint8_t *> dw(copies);
            for (auto &d : dw)
                CK(cudaMalloc(&d, bytes + 16));
            std::vector<float> x = rand_vec((size_t)8 * sh.K);
            float *dx = dup(x), *dy;
            CK(cudaMalloc(&dy, (size_t)8 * sh.N * 4));
            void *dws;
            CK(cudaMalloc(&dws, m40k_gemv_q8_ws_bytes(sh.K, 8)));
            /* "fast": m40k_gemv on real (aligned) weights; "generic": the same weights at
             * W+2, which take its byte-granular fallback kernel; "q8": m40k_gemv_q8 on a
             * quantized x (what the engine runs for quantized weights), "q8+x": the same
             * with the m40k_quantize_q8 of x before each product */
            enum { FAST, GENERIC, Q8, Q8X };
            static const char *const vname[] = {"fast", "generic", "q8", "q8+x"};
            for (int v : {FAST, GENERIC, Q8, Q8X})
            for (int batch : {1, 8}) {
                if (v >= Q8 && std::find(std::begin(q8_types), std::end(q8_types), type) == std::end(q8_types))
                    continue; /* m40k_gemv_q8 reads Q8_0, Q4_0, Q4_K, Q6_K */
                if (v == FAST && (type == M40K_TYPE_Q4_1 || type == M40K_TYPE_Q5_0 || type == M40K_TYPE_Q5_1))
                    continue; /* no fast kernel: "generic" is their number */
                for (auto d : dw)
                    CK(cudaMemcpy(d + (v == GENERIC ? 2 : 0), w.data(), bytes, cudaMemcpyHostToDevice));
                int turn = 0;
                CK(m40k_quantize_q8(dx, sh.K, sh.K, batch, dws, 0));
                auto run = [&]() {
                    const uint8_t *wp = dw[turn++ % copies] + (v == GENERIC ? 2 : 0);
                    if (v == Q8X)
                        CK(m40k_quantize_q8(dx, sh.K, sh.K, batch, dws, 0));
                    if (v >= Q8)
                        CK(m40k_gemv_q8(wp, type, sh.N, sh.K, dws, batch, dy, sh.N, 0));
                    else
                        CK(m40k_gemv(wp, type, sh.N, sh.K, dx, sh.K, dy, sh.N, batch, 0));
                };
                const double us = time_us(run, 50), gbs = bytes / (us * 1e3);
                printf("bench gemv %-7s %-5s N %5d K %5d batch %d: %8.1f us  %7.1f GB/s  %5.1f%% of roofline\n",
                       vname[v], m40_type_name(type), sh.N, sh.K, batch, us, gbs, 100.0 * gbs / peak);
            }
            for (auto d : dw)
                cudaFree(d);
            cudaFree(dx), cudaFree(dy), cudaFree(dws);
        }
}

/* The int8-activation GEMV (m40k_gemv_q8 on an already quantized x) at the products of
 * a Mistral-7B decode step (q+k+v, q/o, k/v, gate+up, down), batch 1 and 2: the small
 * ones are where a step loses most against the roofline. Weights rotated over > 120 MB. */
static void bench_gemv_q8_shapes(void)
{
    const double peak = 3020.0;
    struct { int N, K; } shapes[] = {{6144, 4096},  {4096, 4096},  {1024, 4096},
                                     {28672, 4096}, {4096, 14336}, {32000, 4096}};
    /* each GGUF type, then (-) its regrouped layout (kernels.h 0.) of the same bytes */
    const int tvs[] = {M40K_TYPE_Q8_0, -M40K_TYPE_Q8_0, M40K_TYPE_Q4_K, M40K_TYPE_Q6_K, -M40K_TYPE_Q6_K};
    for (int tv : tvs)
        for (auto sh : shapes) {
            const int type = tv < 0 ? -tv : tv, ktype = tv < 0 ? m40k_g8_type(type, sh.K) : type;
            const size_t bytes = row_bytes(type, sh.K) * sh.N;
            std::vector<uint8_t> w(bytes);
            for (auto &b : w)
                b = (uint8_t)rnd32();
            if (type != M40K_TYPE_Q4_K)
                for (size_t i = 1; i < bytes; i += 2)
                    w[i] &= 0x3B;
            if (ktype != type) {
                std::vector<uint8_t> w8(bytes);
                CK(m40k_repack_g8(type, w.data(), w8.data(), sh.N, sh.K));
                w.swap(w8);
            }
            const int copies = (int)(120000000 / bytes) + 1;
            std::vector<uint8_t *> dw(copies);
            for (auto &d : dw) {
                CK(cudaMalloc(&d, bytes));
                CK(cudaMemcpy(d, w.data(), bytes, cudaMemcpyHostToDevice));
            }
            float *dx = dup(rand_vec((size_t)2 * sh.K)), *dy;
            CK(cudaMalloc(&dy, (size_t)2 * sh.N * 4));
            void *dws;
            CK(cudaMalloc(&dws, m40k_gemv_q8_ws_bytes(sh.K, 2)));
            for (int batch : {1, 2}) {
                CK(m40k_quantize_q8(dx, sh.K, sh.K, batch, dws, 0));
                int turn = 0;
                auto run = [&]() { CK(m40k_gemv_q8(dw[turn++ % copies], ktype, sh.N, sh.K, dws, batch, dy, sh.N, 0)); };
                const double us = time_us(run, 100), gbs = bytes / (us * 1e3);
                printf("bench gemvq8 %-4s%-3s N %5d K %5d batch %d: %8.2f us  %7.1f GB/s  %5.1f%% of roofline\n",
                       m40_type_name(type), ktype != type ? "_G8" : "", sh.N, sh.K, batch, us, gbs, 100.0 * gbs / peak);
            }
            for (auto d : dw)
                cudaFree(d);
            cudaFree(dx), cudaFree(dy), cudaFree(dws);
        }
}

/* F16 decode products of n = 1..8 rows: the tensor-core GEMV m40k_gemm_skinny (picked
 * splits), the F16 m40k_gemv, and cuBLAS's F16 x F16 -> F32 GEMM on an F16 copy of x;
 * weights rotated over > 120 MB, % of the 3.02 TB/s roofline (weights only).
 * Mistral-7B shapes: q/o, q+k+v, k/v, gate+up, down, output. */
/* A benchmark's weights: N x K of type (base or its regrouped G8 layout) with realistic
 * scales (the first 64 rows of quant_matrix tiled), in copies whose total passes the 50
 * MB L2 (a run rotates over them). */
static std::vector<uint8_t *> bench_weights(int type, int base, int N, int K, size_t *bytes_out)
{
    const size_t bytes = row_bytes(base, K) * N;
    std::vector<uint8_t> wq = quant_matrix(base, 64, K), w(bytes);
    for (size_t i = 0; i < bytes; i++)
        w[i] = wq[i % wq.size()];
    if (type != base) {
        std::vector<uint8_t> r(bytes);
        CK(m40k_repack_g8(base, w.data(), r.data(), N, K));
        w.swap(r);
    }
    std::vector<uint8_t *> dw((size_t)(120000000 / bytes) + 2);
    for (auto &d : dw)
        d = dup(w);
    *bytes_out = bytes;
    return dw;
}

/* Prefill's tiled path: each matrix dequantized to F16, then cuBLAS. Serially on one
 * stream, against the dequantization of the next matrix on a second stream into a
 * second scratch while cuBLAS multiplies this one (cuBLAS is bound by the tensor cores
 * at 512 rows, the dequantization by DRAM). Microseconds a matrix. */
static void bench_deq_overlap(void)
{
    cublasHandle_t blas;
    if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS)
        return;
    cudaStream_t s1, s2;
    CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    cublasSetStream(blas, s1);
    struct { int N, K; } shapes[] = {{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}};
    for (auto sh : shapes)
        for (int type : {M40K_TYPE_Q4_K, M40K_TYPE_Q8_0_G8}) {
            const int base = type == M40K_TYPE_Q8_0_G8 ? M40K_TYPE_Q8_0 : type;
            size_t bytes = 0;
            std::vector<uint8_t *> dw = bench_weights(type, base, sh.N, sh.K, &bytes);
            const int copies = (int)dw.size();
            uint16_t *deq[2], *dx;
            float *dy;
            CK(cudaMalloc(&deq[0], (size_t)sh.N * sh.K * 2));
            CK(cudaMalloc(&deq[1], (size_t)sh.N * sh.K * 2));
            CK(cudaMalloc(&dx, (size_t)512 * sh.K * 2));
            CK(cudaMemset(dx, 0, (size_t)512 * sh.K * 2));
            CK(cudaMalloc(&dy, (size_t)512 * sh.N * 4));
            cudaEvent_t dq[2], gm[2], t0, t1;
            for (int b = 0; b < 2; b++) {
                CK(cudaEventCreateWithFlags(&dq[b], cudaEventDisableTiming));
                CK(cudaEventCreateWithFlags(&gm[b], cudaEventDisableTiming));
            }
            CK(cudaEventCreate(&t0));
            CK(cudaEventCreate(&t1));
            for (int M : {128, 256, 512, 1024}) {
                if (M > 512)
                    continue;
                auto gemm = [&](const uint16_t *wf) {
                    const float one = 1.0f, zero = 0.0f;
                    if (cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, sh.N, M, sh.K, &one, wf, CUDA_R_16F, sh.K, dx,
                                     CUDA_R_16F, sh.K, &zero, dy, CUDA_R_32F, sh.N, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
                        CK(cudaErrorUnknown);
                };
                const int iters = 20;
                for (int v = 0; v < 4; v++) { /* 0 serial, 1 overlapped, 2 cuBLAS alone, 3 dequantization alone */
                    if (v == 3 && M != 128)
                        continue;
                    for (int rep = 0; rep < 2; rep++) { /* the first a warm-up */
                        CK(cudaStreamSynchronize(s1));
                        CK(cudaStreamSynchronize(s2));
                        CK(cudaEventRecord(gm[0], s1));
                        CK(cudaEventRecord(gm[1], s1));
                        if (v == 1) {
                            CK(m40k_gemm_q_dequant(dw[0], type, sh.N, sh.K, deq[0], s2));
                            CK(cudaEventRecord(dq[0], s2));
                            CK(cudaStreamWaitEvent(s1, dq[0], 0));
                        }
                        CK(cudaEventRecord(t0, s1));
                        for (int i = 0; i < iters; i++) {
                            const int b = i & 1;
                            if (v == 0) {
                                CK(m40k_gemm_q_dequant(dw[i % copies], type, sh.N, sh.K, deq[0], s1));
                                gemm(deq[0]);
                            } else if (v == 2) {
                                gemm(deq[b]);
                            } else if (v == 3) {
                                CK(m40k_gemm_q_dequant(dw[i % copies], type, sh.N, sh.K, deq[b], s1));
                            } else {
                                CK(cudaStreamWaitEvent(s2, gm[1 - b], 0)); /* the product that read buf 1-b */
                                CK(m40k_gemm_q_dequant(dw[(i + 1) % copies], type, sh.N, sh.K, deq[1 - b], s2));
                                CK(cudaEventRecord(dq[1 - b], s2));
                                CK(cudaStreamWaitEvent(s1, dq[b], 0));
                                gemm(deq[b]);
                                CK(cudaEventRecord(gm[b], s1));
                            }
                        }
                        CK(cudaEventRecord(t1, s1));
                        CK(cudaEventSynchronize(t1));
                        CK(cudaStreamSynchronize(s2));
                        float ms = 0;
                        CK(cudaEventElapsedTime(&ms, t0, t1));
                        if (rep == 1)
                            printf("bench deq %-6s%s N %5d K %5d M %3d %-10s: %8.1f us a matrix\n", m40_type_name(base),
                                   type != base ? "_G8" : "", sh.N, sh.K, M,
                                   v == 0 ? "serial" : v == 1 ? "overlapped" : v == 2 ? "blas only" : "deq only",
                                   ms * 1000.0 / iters);
                        if (rep == 1 && v == 3)
                            printf("bench deq: %.1f GB/s (weights read + F16 written)\n",
                                   (bytes + (double)sh.N * sh.K * 2) / (ms * 1e6 / iters));
                    }
                }
            }
            for (auto &d : dw)
                cudaFree(d);
            cudaFree(deq[0]), cudaFree(deq[1]), cudaFree(dx), cudaFree(dy);
            for (int b = 0; b < 2; b++)
                cudaEventDestroy(dq[b]), cudaEventDestroy(gm[b]);
            cudaEventDestroy(t0), cudaEventDestroy(t1);
        }
    cublasDestroy(blas);
    cudaStreamDestroy(s1), cudaStreamDestroy(s2);
}

/* The quantized GEMM (m40k_gemm_q) at a 7B step's shapes against the path it replaces
 * (the matrix dequantized to F16 by m40k_gemm_q_dequant, then cublasGemmEx) and against cuBLAS on
 * F16 weights: microseconds, weight bytes read per second (against the H100's 3.02 TB/s)
 * and tensor TFLOP/s. Weights rotate over copies past the 50 MB L2. */
static void bench_gemm_q(void)
{
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cublasHandle_t blas;
    if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS) {
        printf("bench gemm_q: no cuBLAS\n");
        return;
    }
    struct { int N, K; } shapes[] = {{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}};
    const int types[] = {M40K_TYPE_Q4_K, M40K_TYPE_Q6_K_G8, M40K_TYPE_Q8_0_G8};
    const int maxM = 512;
    /* M40_BENCH_SHAPE=NxK: that shape only (for a profiler run) */
    const char *only = getenv("M40_BENCH_SHAPE");
    for (auto sh : shapes) {
        char name[32];
        snprintf(name, sizeof name, "%dx%d", sh.N, sh.K);
        if (only && strcmp(only, name))
            continue;
        uint16_t *dx16, *ddeq;
        float *dy, *dws;
        std::vector<float> xf = rand_vec((size_t)maxM * sh.K);
        std::vector<uint16_t> x16(xf.size());
        for (size_t i = 0; i < xf.size(); i++)
            x16[i] = m40_fp32_to_fp16(xf[i]);
        dx16 = dup(x16);
        const size_t wsf = (size_t)16 << 20;
        CK(cudaMalloc(&dy, (size_t)maxM * sh.N * 4));
        CK(cudaMalloc(&dws, wsf * 4));
        CK(cudaMalloc(&ddeq, (size_t)sh.N * sh.K * 2));
        std::vector<int32_t> iota(sh.N);
        for (int i = 0; i < sh.N; i++)
            iota[i] = i;
        int32_t *diota = dup(iota);
        int *dcnt = dup(std::vector<int>(m40k_gemm_q_counter_ints(sh.N, maxM), 0));
        for (int type : types) {
            const int base = type == M40K_TYPE_Q8_0_G8 ? M40K_TYPE_Q8_0 : type == M40K_TYPE_Q6_K_G8 ? M40K_TYPE_Q6_K : type;
            if (sh.K % m40_type_get((uint32_t)base)->block_elems || (type == M40K_TYPE_Q6_K_G8 && sh.K % 2048))
                continue;
            size_t bytes = 0;
            std::vector<uint8_t *> dw = bench_weights(type, base, sh.N, sh.K, &bytes);
            const int copies = (int)dw.size();
            for (int M : {4, 8, 16, 32, 64, 128, 256, 512}) {
                /* M40_BENCH_M=16,64: those row counts only */
                const char *ms = getenv("M40_BENCH_M");
                if (ms && *ms) {
                    char mb[16];
                    snprintf(mb, sizeof mb, ",%d,", M);
                    std::string list = std::string(",") + ms + ",";
                    if (list.find(mb) == std::string::npos)
                        continue;
                }
                /* 0 gemm_q as the engine calls it; 1 dequantize + cuBLAS; where the register
                 * kernel takes M: 2 the shared-memory kernel instead, 3 and 4 the register
                 * kernel at half and twice the picked splits */
                for (int v = 0; v < 5; v++) {
                    const bool reg = m40k_gemm_q_kernel(type, sh.K, M, dw[0]) == M40K_GEMM_Q_REGISTER;
                    if (v >= 2 && !reg)
                        continue;
                    m40k_gemm_q_tune(v == 2 ? 0 : 64);
                    int S = m40k_gemm_q_pick_splits(type, sh.N, sh.K, M, sms, wsf, m40k_gemm_q_counter_ints(sh.N, maxM));
                    if (v == 3) {
                        if (S == 1)
                            continue;
                        S /= 2;
                    } else if (v == 4) {
                        if (2 * S > sh.K / 256)
                            continue;
                        S *= 2;
                    }
                    int turn = 0;
                    auto run = [&]() {
                        const uint8_t *wp = dw[turn++ % copies];
                        if (v != 1) {
                            CK(m40k_gemm_q(wp, type, sh.N, sh.K, dx16, sh.K, M, dy, sh.N, S, dws, dcnt, 0));
                        } else {
                            if (m40k_gemm_q_dequant(wp, type, sh.N, sh.K, ddeq, 0) != 0)
                                CK(m40k_embed(wp, type, sh.N, sh.K, diota, sh.N, ddeq, M40K_TYPE_F16, sh.K, 0));
                            const float one = 1.0f, zero = 0.0f;
                            if (cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, sh.N, M, sh.K, &one, ddeq, CUDA_R_16F,
                                             sh.K, dx16, CUDA_R_16F, sh.K, &zero, dy, CUDA_R_32F, sh.N,
                                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
                                CK(cudaErrorUnknown);
                        }
                    };
                    const double us = time_us(run, 20), gbs = bytes / (us * 1e3);
                    const double tf = 2.0 * sh.N * sh.K * M / (us * 1e6);
                    static const char *const names[] = {"gemm_q", "deq+blas", "tile", "reg S/2", "reg S*2"};
                    printf("bench %-8s %-8s %-8s N %5d K %5d M %3d S %2d: %8.1f us  %7.1f GB/s (%5.1f%%)  %6.1f TFLOP/s\n",
                           m40_type_name(base), type != base ? "G8" : "", names[v], sh.N, sh.K, M, v != 1 ? S : 0, us,
                           gbs, 100.0 * gbs / 3020.0, tf);
                    m40k_gemm_q_tune(64);
                }
            }
            /* the int8 tensor-core kernel (8f): the product alone, and with the quantization of x */
            if (m40k_gemm_x8_reads(type, sh.K, 16, dw[0])) {
                void *dxq;
                CK(cudaMalloc(&dxq, m40k_x8_bytes(sh.K, 64)));
                for (int M : {4, 8, 16, 32, 64}) {
                    CK(m40k_quantize_x8(dx16, sh.K, sh.K, M, dxq, 0));
                    const int S = m40k_gemm_x8_pick_splits(type, sh.N, sh.K, M, sms);
                    for (int v = 0; v < 2; v++) {
                        int turn = 0;
                        auto run = [&]() {
                            if (v == 1)
                                CK(m40k_quantize_x8(dx16, sh.K, sh.K, M, dxq, 0));
                            CK(m40k_gemm_x8(dw[turn++ % copies], type, sh.N, sh.K, dxq, M, dy, sh.N, S, dws, dcnt, 0));
                        };
                        const double us = time_us(run, 20), gbs = bytes / (us * 1e3);
                        printf("bench %-8s %-8s %-8s N %5d K %5d M %3d S %2d: %8.1f us  %7.1f GB/s (%5.1f%%)  %6.1f "
                               "TFLOP/s\n",
                               m40_type_name(base), type != base ? "G8" : "", v ? "x8+quant" : "x8", sh.N, sh.K, M, S,
                               us, gbs, 100.0 * gbs / 3020.0, 2.0 * sh.N * sh.K * M / (us * 1e6));
                    }
                }
                cudaFree(dxq);
            }
            for (auto &d : dw)
                cudaFree(d);
        }
        /* cuBLAS on F16 weights, the same shapes: what the F16 models get */
        {
            std::vector<uint16_t> w((size_t)sh.N * sh.K);
            for (auto &h : w)
                h = (uint16_t)(0x3000 + rnd32() % 0x0C00) ^ (uint16_t)((rnd32() & 1) << 15);
            const size_t bytes = w.size() * 2;
            const int copies = (int)(120000000 / bytes) + 1;
            std::vector<uint16_t *> dw(copies);
            for (auto &d : dw)
                d = dup(w);
            for (int M : {16, 32, 64, 128, 256, 512}) {
                int turn = 0;
                auto run = [&]() {
                    const float one = 1.0f, zero = 0.0f;
                    if (cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, sh.N, M, sh.K, &one, dw[turn++ % copies],
                                     CUDA_R_16F, sh.K, dx16, CUDA_R_16F, sh.K, &zero, dy, CUDA_R_32F, sh.N,
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
                        CK(cudaErrorUnknown);
                };
                const double us = time_us(run, 20), gbs = bytes / (us * 1e3);
                printf("bench F16      cublas  N %5d K %5d M %3d     : %8.1f us  %7.1f GB/s (%5.1f%%)  %6.1f TFLOP/s\n",
                       sh.N, sh.K, M, us, gbs, 100.0 * gbs / 3020.0, 2.0 * sh.N * sh.K * M / (us * 1e6));
            }
            for (auto &d : dw)
                cudaFree(d);
        }
        cudaFree(dx16), cudaFree(dy), cudaFree(dws), cudaFree(ddeq), cudaFree(diota), cudaFree(dcnt);
    }
    cublasDestroy(blas);
}

/* What a product of the register kernel costs that does not scale with its work: the
 * same N and M at K 256 .. 4096 (the line's intercept), each at the picked split count
 * and at one split, timed as the engine runs them (20 launches captured in a CUDA graph
 * on a stream of its own, PDL edges between them), weights rotated over > 120 MB. */
static void bench_gemm_q_fixed(void)
{
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(m40k_gemm_q_prepare());
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const int maxM = 64, maxN = 28672, maxK = 4096, iters = 20;
    std::vector<float> xf = rand_vec((size_t)maxM * maxK);
    std::vector<uint16_t> x16(xf.size());
    for (size_t i = 0; i < xf.size(); i++)
        x16[i] = m40_fp32_to_fp16(xf[i]);
    uint16_t *dx = dup(x16);
    float *dy, *dws;
    const size_t wsf = (size_t)16 << 20;
    CK(cudaMalloc(&dy, (size_t)maxM * maxN * 4));
    CK(cudaMalloc(&dws, wsf * 4));
    const size_t cnt_ints = m40k_gemm_q_counter_ints(maxN, maxM);
    int *dcnt = dup(std::vector<int>(cnt_ints, 0));
    for (int type : {M40K_TYPE_Q4_K, M40K_TYPE_Q8_0_G8})
        for (int N : {4096, 28672})
            for (int K : {256, 512, 1024, 2048, 4096}) {
                const int base = type == M40K_TYPE_Q8_0_G8 ? M40K_TYPE_Q8_0 : type;
                size_t bytes = 0;
                std::vector<uint8_t *> dw = bench_weights(type, base, N, K, &bytes);
                const int copies = (int)dw.size();
                for (int M : {16, 64}) {
                    const int pick = m40k_gemm_q_pick_splits(type, N, K, M, sms, wsf, cnt_ints);
                    for (int S : {pick, 1}) {
                        cudaGraph_t g;
                        cudaGraphExec_t ge;
                        int turn = 0;
                        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
                        for (int i = 0; i < iters; i++)
                            CK(m40k_gemm_q(dw[turn++ % copies], type, N, K, dx, K, M, dy, N, S, dws, dcnt, st));
                        CK(cudaStreamEndCapture(st, &g));
                        CK(cudaGraphInstantiate(&ge, g, 0));
                        auto run = [&] { CK(cudaGraphLaunch(ge, st)); };
                        run();
                        CK(cudaStreamSynchronize(st));
                        cudaEvent_t e0, e1;
                        CK(cudaEventCreate(&e0));
                        CK(cudaEventCreate(&e1));
                        CK(cudaEventRecord(e0, st));
                        for (int r = 0; r < 10; r++)
                            run();
                        CK(cudaEventRecord(e1, st));
                        CK(cudaEventSynchronize(e1));
                        float ms = 0;
                        CK(cudaEventElapsedTime(&ms, e0, e1));
                        const double us = ms * 1000.0 / (10.0 * iters);
                        printf("bench fixed %-6s N %5d K %5d M %2d S %2d: %7.2f us  (DRAM bound %6.2f us)\n",
                               m40_type_name(base), N, K, M, S, us, bytes / 3020.0e3);
                        cudaEventDestroy(e0), cudaEventDestroy(e1);
                        cudaGraphExecDestroy(ge), cudaGraphDestroy(g);
                        if (pick == 1)
                            break;
                    }
                }
                for (auto &d : dw)
                    cudaFree(d);
            }
    cudaFree(dx), cudaFree(dy), cudaFree(dws), cudaFree(dcnt);
    cudaStreamDestroy(st);
}

static void bench_skinny(void)
{
    const double peak = 3020.0;
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cublasHandle_t blas;
    if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS) {
        printf("bench skinny: no cuBLAS\n");
        return;
    }
    struct { int N, K; } shapes[] = {{4096, 4096}, {6144, 4096}, {1024, 4096}, {28672, 4096}, {4096, 14336}, {32000, 4096}};
    for (auto sh : shapes) {
        const size_t bytes = (size_t)sh.N * sh.K * 2;
        std::vector<uint16_t> w((size_t)sh.N * sh.K);
        for (auto &h : w)
            h = (uint16_t)(0x3000 + rnd32() % 0x0C00) ^ (uint16_t)((rnd32() & 1) << 15);
        const int copies = (int)(120000000 / bytes) + 1;
        std::vector<uint16_t *> dw(copies);
        for (auto &d : dw)
            d = dup(w);
        std::vector<float> x = rand_vec((size_t)8 * sh.K);
        std::vector<uint16_t> x16(x.size());
        for (size_t i = 0; i < x.size(); i++)
            x16[i] = m40_fp32_to_fp16(x[i]);
        float *dx = dup(x), *dy, *dws;
        uint16_t *dx16 = dup(x16);
        const size_t wsf = (size_t)1 << 20;
        CK(cudaMalloc(&dy, (size_t)8 * sh.N * 4));
        CK(cudaMalloc(&dws, wsf * 4));
        int *dcnt = dup(std::vector<int>(m40k_gemm_skinny_counter_ints(sh.N), 0));
        for (int n : {1, 2, 4, 8})
            for (int v = 0; v < 3; v++) { /* 0 skinny, 1 cuBLAS, 2 GEMV */
                const int S = m40k_gemm_skinny_pick_splits(sh.N, sh.K, n, sms, wsf, m40k_gemm_skinny_counter_ints(sh.N));
                int turn = 0;
                auto run = [&]() {
                    const uint16_t *wp = dw[turn++ % copies];
                    if (v == 0)
                        CK(m40k_gemm_skinny(wp, sh.N, sh.K, dx, sh.K, n, dy, sh.N, S, dws, dcnt, 0));
                    else if (v == 2)
                        CK(m40k_gemv(wp, M40K_TYPE_F16, sh.N, sh.K, dx, sh.K, dy, sh.N, n, 0));
                    else {
                        const float one = 1.0f, zero = 0.0f;
                        if (cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, sh.N, n, sh.K, &one, wp, CUDA_R_16F, sh.K,
                                         dx16, CUDA_R_16F, sh.K, &zero, dy, CUDA_R_32F, sh.N, CUBLAS_COMPUTE_32F,
                                         CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
                            CK(cudaErrorUnknown);
                    }
                };
                const double us = time_us(run, 30), gbs = bytes / (us * 1e3);
                static const char *const vn[] = {"skinny", "cublas", "gemv"};
                printf("bench f16 %-6s N %5d K %5d n %2d%s: %8.1f us  %7.1f GB/s  %5.1f%% of roofline\n", vn[v], sh.N,
                       sh.K, n, v == 0 ? (S > 1 ? " (split)" : "        ") : "        ", us, gbs, 100.0 * gbs / peak);
            }
        if (sh.K >= 2 * sh.N) /* the down projection: also with its SwiGLU formed from gate and up rows */
            for (int n : {1, 2}) {
                const int S = m40k_gemm_skinny_pick_splits(sh.N, sh.K, n, sms, wsf, m40k_gemm_skinny_counter_ints(sh.N));
                float *dgu = dup(rand_vec((size_t)n * 2 * sh.K, -4, 4));
                int turn = 0;
                auto run = [&]() {
                    CK(m40k_gemm_skinny_glu(M40K_GLU_SILU, dw[turn++ % copies], sh.N, sh.K, dgu, dgu + sh.K, 2 * sh.K,
                                            n, dy, sh.N, S, dws, dcnt, 0));
                };
                const double us = time_us(run, 50), gbs = bytes / (us * 1e3);
                printf("bench f16 skinny_glu N %5d K %5d n %2d: %8.1f us  %7.1f GB/s  %5.1f%% of roofline\n", sh.N,
                       sh.K, n, us, gbs, 100.0 * gbs / peak);
                cudaFree(dgu);
            }
        for (auto d : dw)
            cudaFree(d);
        cudaFree(dx), cudaFree(dx16), cudaFree(dy), cudaFree(dws), cudaFree(dcnt);
    }
    cublasDestroy(blas);
}

/* Paged decode attention, Mistral-7B heads (32 query / 8 KV heads, head_dim 128): time
 * per call at the split count the engine picks and at fixed ones, and the K/V bytes read
 * per second. */
static void bench_attn_decode(void)
{
    const int nh = 32, nkv = 8, hd = 128;
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    for (int n_seqs : {1, 8, 16, 64})
        for (int ctx : {576, 4096}) {
            if (n_seqs == 8 && ctx == 4096)
                continue;
            const int pages = (ctx + M40K_PAGE - 1) / M40K_PAGE;
            std::vector<int32_t> indptr(n_seqs + 1), indices((size_t)n_seqs * pages), lpl(n_seqs);
            for (int s = 0; s <= n_seqs; s++)
                indptr[s] = s * pages;
            for (size_t i = 0; i < indices.size(); i++) /* interleaved sequences */
                indices[i] = (int32_t)((i % pages) * n_seqs + i / pages);
            for (int s = 0; s < n_seqs; s++)
                lpl[s] = ctx - (pages - 1) * M40K_PAGE;
            const size_t cache = (size_t)n_seqs * pages * nkv * M40K_PAGE * hd;
            std::vector<uint16_t> kv(cache);
            for (auto &h : kv)
                h = (uint16_t)(0x3000 + rnd32() % 0x0C00); /* small positive halves */
            uint16_t *dk = dup(kv), *dv = dup(kv);
            std::vector<float> q = rand_vec((size_t)n_seqs * nh * hd);
            float *dq = dup(q), *dout, *dws;
            CK(cudaMalloc(&dout, q.size() * 4));
            CK(cudaMalloc(&dws, m40k_decode_workspace_floats(n_seqs, nh, hd, 64) * 4 + 4));
            int *dcnt = dup(std::vector<int>(m40k_decode_counter_ints(n_seqs, nkv), 0));
            int32_t *dip = dup(indptr), *dix = dup(indices), *dlp = dup(lpl);
            const int pick = m40k_decode_pick_splits(n_seqs, nkv, ctx, sms);
            for (int splits : {pick, 1, 2, 4, 8, 16, 64}) {
                auto run = [&] {
                    CK(m40k_attn_decode(dout, nh * hd, dq, nh * hd, dk, dv, dip, dix, dlp, n_seqs, nh, nkv, hd, 0.088f,
                                        splits, dws, dcnt, 0));
                };
                const double us = time_us(run, 50), bytes = (double)n_seqs * ctx * nkv * hd * 2 * 2;
                printf("bench attn_decode seqs %2d ctx %4d splits %2d%s: %8.1f us  %7.1f GB/s of K/V\n", n_seqs, ctx,
                       splits, splits == pick ? " (picked)" : "", us, bytes / (us * 1e3));
            }
            {   /* the step's RoPE + append: fused into the decode kernel, and the two launches it replaces */
                const int64_t rs = (int64_t)(nh + 2 * nkv) * hd;
                std::vector<float> qkv = rand_vec((size_t)n_seqs * rs);
                std::vector<int32_t> one(n_seqs + 1), pos(n_seqs, ctx - 1);
                for (int s = 0; s <= n_seqs; s++)
                    one[s] = s;
                float *dqkv = dup(qkv);
                int32_t *done = dup(one), *dp = dup(pos);
                auto fused = [&] {
                    CK(m40k_attn_decode_rope(dout, nh * hd, dqkv, rs, dqkv + nh * hd, rs, dqkv + (nh + nkv) * hd, rs,
                                             dk, dv, dip, dix, dlp, n_seqs, nh, nkv, hd, 0.088f, 0, 0.0f, dp, hd, 1e6f,
                                             nullptr, 0, pick, dws, dcnt, nullptr, 0));
                };
                auto two = [&] {
                    CK(m40k_kv_append_rope(dqkv, rs, nh, dk, dv, dqkv + nh * hd, rs, dqkv + (nh + nkv) * hd, rs, done,
                                           n_seqs, n_seqs, dip, dix, dlp, nkv, hd, dp, hd, 1e6f, nullptr, 0, 0));
                    CK(m40k_attn_decode(dout, nh * hd, dqkv, rs, dk, dv, dip, dix, dlp, n_seqs, nh, nkv, hd, 0.088f,
                                        pick, dws, dcnt, 0));
                };
                const double uf = time_us(fused, 50), u2 = time_us(two, 50);
                printf("bench attn_decode_rope seqs %2d ctx %4d splits %2d: fused %8.1f us, append_rope + decode %8.1f us\n",
                       n_seqs, ctx, pick, uf, u2);
                cudaFree(dqkv), cudaFree(done), cudaFree(dp);
            }
            cudaFree(dk), cudaFree(dv), cudaFree(dq), cudaFree(dout), cudaFree(dws), cudaFree(dcnt);
            cudaFree(dip), cudaFree(dix), cudaFree(dlp);
        }
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
    /* --bench-only: the benchmarks without the comparisons (for timing several builds) */
    const bool bench_only = argc > 1 && strcmp(argv[1], "--bench-only") == 0;
    const bool bench = bench_only || (argc > 1 && strcmp(argv[1], "--bench") == 0);
    struct { const char *name; void (*fn)(void); } tests[] = {
        {"embed", test_embed},         {"embed_g8", test_embed_g8}, {"rmsnorm", test_rmsnorm},
        {"add_rmsnorm", test_add_rmsnorm},
        {"rope", test_rope},           {"act", test_act}, {"fused_q8", test_fused_q8},
        {"fused_f16", test_fused_f16}, {"add_rmsnorm_to", test_add_rmsnorm_to}, {"attention", test_attention},
        {"kv_rope", test_kv_append_rope}, {"attn_rope", test_attn_decode_rope},
        {"attn_hsplit", test_attn_head_split}, {"attn_plain", test_attn_decode_plain},
        {"gemv", test_gemv},           {"gemv_q8", test_gemv_q8}, {"gemv_q8_pair", test_gemv_q8_pair},
        {"gemv_q8_norm", test_gemv_q8_norm},
        {"gemv_q8_argmax", test_gemv_q8_argmax},
        {"skinny", test_gemm_skinny},
        {"skinny_glu", test_gemm_skinny_glu},
        {"gemm_q", test_gemm_q},
        {"gemm_x8", test_gemm_x8},
        {"f32_to_f16", test_f32_to_f16},
        {"sample", test_sample},
    };
    /* M40_TEST_ONLY=name,name: only those tests (for a quick check of one kernel) */
    const char *only = getenv("M40_TEST_ONLY");
    for (auto &t : tests) {
        if (bench_only)
            break;
        if (only && *only) {
            bool listed = false;
            for (const char *p = only; *p;) {
                const size_t len = strcspn(p, ",");
                if (len == strlen(t.name) && strncmp(p, t.name, len) == 0)
                    listed = true;
                p += len + (p[len] == ',');
            }
            if (!listed)
                continue;
        }
        int f0 = n_fail, p0 = n_pass;
        t.fn();
        printf("%-10s %d passed, %d failed\n", t.name, n_pass - p0, n_fail - f0);
    }
    if (bench) { /* --bench [gemv] [skinny] [attn]: those only; none named: all */
        auto want = [&](const char *w) {
            if (argc <= 2)
                return true;
            for (int i = 2; i < argc; i++)
                if (strcmp(argv[i], w) == 0)
                    return true;
            return false;
        };
        if (want("gemv"))
            bench_gemv();
        if (want("gemvq8"))
            bench_gemv_q8_shapes();
        if (want("skinny"))
            bench_skinny();
        if (want("attn"))
            bench_attn_decode();
        if (want("gemmq"))
            bench_gemm_q();
        if (want("gemmqfixed"))
            bench_gemm_q_fixed();
        if (want("deqov"))
            bench_deq_overlap();
    }
    printf("%d passed, %d failed, %d skipped\n", n_pass, n_fail, n_skip);
    return n_fail ? 1 : 0;
}
