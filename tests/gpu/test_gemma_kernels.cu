/* Gemma's kernels against their CPU twins (kernels/ref/cpu_ref.c) on random inputs:
 *   - the sliding-window attention variants (decode with and without splits, prefill,
 *     and the shape-agnostic generic kernel), windows from 1 to longer than the context,
 *     each without and with Gemma 2's soft-cap of the scores (0.7: the scores here reach
 *     about +-3, so the cap changes them well beyond the tolerance);
 *   - per-head RMSNorm, scale and logit soft-capping (kernels/model_aux.h).
 * Ends with "N passed, N failed, N skipped"; without a GPU it skips. */
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
#include "model_aux.h"

#define GPU_CHECK_SEED 0x2545F4914F6CDD1Dull
#include "gpu_check.h"

static void check(const char *what, bool ok)
{
    if (ok)
        n_pass++;
    else
        n_fail++, printf("FAIL %s\n", what);
}

/* ---------------------------------------------------------------- paged cache fixture */
#include "paged_fixture.h"

static void test_window_attention(void)
{
    const std::vector<int> lens = {1, 15, 17, 100, 700}, news = {1, 15, 3, 100, 37};
    for (int hd : {24, 64, 128, 256})
        for (int G : {1, 4}) {
            const int nkv = 2, nh = nkv * G;
            const float scale = 0.0625f;
            Paged p = make_paged(lens, 3);
            const size_t cache_elems = (size_t)p.n_blocks * nkv * M40K_PAGE * hd;
            std::vector<uint16_t> kc(cache_elems), vc(cache_elems);
            for (size_t i = 0; i < cache_elems; i++)
                kc[i] = m40_fp32_to_fp16(frand(-2, 2)), vc[i] = m40_fp32_to_fp16(frand(-1, 1));
            std::vector<int32_t> new_indptr = {0}, row_seq, row_pos;
            for (size_t s = 0; s < news.size(); s++) {
                new_indptr.push_back(new_indptr.back() + news[s]);
                for (int i = 0; i < news[s]; i++)
                    row_seq.push_back((int)s), row_pos.push_back(lens[s] - news[s] + i);
            }
            const int nt = new_indptr.back();
            const int64_t qs = nh * hd + 4, os = nh * hd + 8;
            uint16_t *dkc = dup(kc), *dvc = dup(vc);
            int32_t *dip = dup(p.indptr), *dix = dup(p.indices), *dlp = dup(p.lpl), *dni = dup(new_indptr);
            int32_t *drs = dup(row_seq), *drp = dup(row_pos);
            std::vector<float> q = rand_vec((size_t)nt * qs, -2, 2);
            float *dq = dup(q), *dout, *dws;
            CK(cudaMalloc(&dout, (size_t)nt * os * 4));
            CK(cudaMalloc(&dws, m40k_decode_workspace_floats(p.n_seqs, nh, hd, 64) * 4 + 64));
            /* split counters: zeroed once here, left zero by every decode call */
            const size_t n_cnt = m40k_decode_counter_ints(p.n_seqs, nkv);
            int *dcnt = dup(std::vector<int>(n_cnt, 0));
            char what[160];
            for (float cap : {0.0f, 0.7f})
            for (int window : {0, 1, 5, 16, 33, 512, 2000}) {
                const bool tuned = hd != 24;
                if (tuned) {
                    /* decode: one query per sequence (the first rows of q) */
                    std::vector<float> c((size_t)p.n_seqs * os, 0.0f);
                    m40_ref_attn_decode_window(c.data(), os, q.data(), qs, kc.data(), vc.data(), p.indptr.data(),
                                               p.indices.data(), p.lpl.data(), p.n_seqs, nh, nkv, hd, scale, window,
                                               cap);
                    for (int splits : {1, 3, 8, 64})
                        for (int rep = 0; rep < 2; rep++) { /* twice: the counters were reset */
                            CK(cudaMemset(dout, 0, (size_t)nt * os * 4));
                            CK(m40k_attn_decode_window(dout, os, dq, qs, dkc, dvc, dip, dix, dlp, p.n_seqs, nh, nkv,
                                                       hd, scale, window, cap, splits, splits > 1 ? dws : nullptr,
                                                       splits > 1 ? dcnt : nullptr, 0));
                            std::vector<float> g = back(dout, c.size());
                            snprintf(what, sizeof what,
                                     "attn_decode_window hd %d G %d window %d cap %g splits %d call %d", hd, G, window,
                                     cap, splits, rep + 1);
                            compare(what, g.data(), c.data(), c.size(), 2e-4f, 1e-3f);
                        }
                    std::vector<int> cnt = back(dcnt, n_cnt);
                    snprintf(what, sizeof what, "attn_decode_window hd %d G %d window %d: counters left zero", hd, G,
                             window);
                    check(what, std::all_of(cnt.begin(), cnt.end(), [](int v) { return v == 0; }));
                    /* prefill: the new tokens of every sequence */
                    std::vector<float> pc((size_t)nt * os, 0.0f);
                    m40_ref_attn_prefill_window(pc.data(), os, q.data(), qs, new_indptr.data(), p.n_seqs, nt,
                                                kc.data(), vc.data(), p.indptr.data(), p.indices.data(),
                                                p.lpl.data(), nh, nkv, hd, scale, window, cap);
                    CK(cudaMemset(dout, 0, (size_t)nt * os * 4));
                    CK(m40k_attn_prefill_window(dout, os, dq, qs, dni, p.n_seqs, nt, dkc, dvc, dip, dix, dlp, nh, nkv,
                                                hd, scale, window, cap, 0));
                    std::vector<float> g = back(dout, pc.size());
                    snprintf(what, sizeof what, "attn_prefill_window hd %d G %d window %d cap %g rows %d", hd, G,
                             window, cap, nt);
                    compare(what, g.data(), pc.data(), pc.size(), 2e-4f, 1e-3f);
                }
                /* generic: same rows, any head size */
                std::vector<float> gc((size_t)nt * os, 0.0f);
                m40_ref_attn_generic_window(gc.data(), os, q.data(), qs, row_seq.data(), row_pos.data(), nt,
                                            kc.data(), vc.data(), p.indptr.data(), p.indices.data(), nh, nkv, hd,
                                            scale, window, cap);
                CK(cudaMemset(dout, 0, (size_t)nt * os * 4));
                CK(m40k_attn_generic_window(dout, os, dq, qs, drs, drp, nt, dkc, dvc, dip, dix, nh, nkv, hd, scale,
                                            window, cap, 0));
                std::vector<float> g = back(dout, gc.size());
                snprintf(what, sizeof what, "attn_generic_window hd %d G %d window %d cap %g rows %d", hd, G, window,
                         cap, nt);
                compare(what, g.data(), gc.data(), gc.size(), 2e-4f, 1e-3f);
            }
            cudaFree(dq), cudaFree(dout), cudaFree(dws), cudaFree(dcnt), cudaFree(dkc), cudaFree(dvc), cudaFree(dip),
                cudaFree(dix), cudaFree(dlp), cudaFree(dni), cudaFree(drs), cudaFree(drp);
        }
}

static void test_elementwise(void)
{
    char what[128];
    for (int hd : {24, 100, 256})
        for (int nheads : {1, 4}) {
            const int rows = 37;
            const int64_t stride = (int64_t)nheads * hd * 3 + 5; /* q inside a wider qkv row */
            std::vector<float> x = rand_vec((size_t)rows * stride, -3, 3), w = rand_vec(hd, 0.5f, 1.5f);
            float *dx = dup(x), *dw = dup(w);
            CK(m40k_rmsnorm_heads(dx, stride, nheads, hd, dw, rows, 1e-6f, 0));
            m40_ref_rmsnorm_heads(x.data(), stride, nheads, hd, w.data(), rows, 1e-6f);
            std::vector<float> g = back(dx, x.size());
            snprintf(what, sizeof what, "rmsnorm_heads hd %d heads %d rows %d", hd, nheads, rows);
            compare(what, g.data(), x.data(), x.size(), 1e-5f, 1e-5f);
            cudaFree(dx), cudaFree(dw);
        }
    /* Q's and K's norms in one launch: the k heads right after the q heads of each row */
    for (int hd : {24, 128, 256})
        for (int nq : {1, 8, 32})
            for (int nk : {1, 4}) {
                const int rows = nq == 32 ? 3 : 37;
                const int64_t stride = (int64_t)(nq + 2 * nk) * hd + 4;
                std::vector<float> x = rand_vec((size_t)rows * stride, -3, 3), wq = rand_vec(hd, 0.5f, 1.5f),
                                   wk = rand_vec(hd, 0.5f, 1.5f);
                float *dx = dup(x), *dwq = dup(wq), *dwk = dup(wk);
                CK(m40k_rmsnorm_qk(dx, stride, nq, nk, hd, dwq, dwk, rows, 1e-6f, 0));
                m40_ref_rmsnorm_heads(x.data(), stride, nq, hd, wq.data(), rows, 1e-6f);
                m40_ref_rmsnorm_heads(x.data() + (size_t)nq * hd, stride, nk, hd, wk.data(), rows, 1e-6f);
                std::vector<float> g = back(dx, x.size());
                snprintf(what, sizeof what, "rmsnorm_qk hd %d q heads %d k heads %d rows %d", hd, nq, nk, rows);
                compare(what, g.data(), x.data(), x.size(), 1e-5f, 1e-5f);
                cudaFree(dx), cudaFree(dwq), cudaFree(dwk);
            }
    const int64_t n = 100003;
    std::vector<float> x = rand_vec(n, -100, 100);
    float *dx = dup(x);
    CK(m40k_scale(dx, n, 25.298221f, 0));
    m40_ref_scale(x.data(), n, 25.298221f);
    std::vector<float> g = back(dx, n);
    compare("scale", g.data(), x.data(), n, 0.0f, 1e-7f);
    CK(m40k_softcap(dx, n, 30.0f, 0));
    m40_ref_softcap(x.data(), n, 30.0f);
    g = back(dx, n);
    compare("softcap 30", g.data(), x.data(), n, 1e-5f, 1e-5f);
    cudaFree(dx);
}

int main(void)
{
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        printf("SKIP: no CUDA device (%s)\n", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        printf("0 passed, 0 failed, 1 skipped\n");
        return 0;
    }
    struct { const char *name; void (*fn)(void); } tests[] = {
        {"window attention", test_window_attention}, {"elementwise", test_elementwise}};
    for (auto &t : tests) {
        int f0 = n_fail, p0 = n_pass;
        t.fn();
        printf("%-18s %d passed, %d failed\n", t.name, n_pass - p0, n_fail - f0);
    }
    printf("%d passed, %d failed, 0 skipped\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
