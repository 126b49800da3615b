/* Attention sinks (gpt-oss; kernels.h 6d, 7e, model_aux.h) against their CPU twins
 * (m40_ref_attn_prefill_sinks, m40_ref_attn_generic_sinks) on random paged caches:
 *   - the decode kernel with its own K/V append (m40k_attn_decode_rope, option sinks, rot_dim
 *     0), one block a sequence and split 3, 8 and 40 ways (the workspace merge, and the
 *     cluster merge where sm_90 takes it), twice each (the counters come back zero);
 *   - the SIMT prefill, the tensor-core prefill in one block and in 1..4 key splits
 *     (m40k_attn_prefill_tc_split_sinks: the merge kernel applies the sink), and the auto
 *     pick between them;
 *   - the generic kernel (any head size: 32, gpt-oss-tiny's, and 40);
 * with and without a window, with and without Gemma 2's soft-cap, sinks from -3 to 3 and
 * one of 20 (the sink takes nearly all the mass: the rescaling must not overflow), and
 * NULL sinks, which must give the results of the calls without the suffix bit for bit.
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

#define GPU_CHECK_SEED 0x9E3779B97F4A7C15ull
#include "gpu_check.h"

static void check(const char *what, bool ok)
{
    if (ok)
        n_pass++;
    else
        n_fail++, printf("FAIL %s\n", what);
}

#include "paged_fixture.h"

static void test_sinks(const std::vector<int> &lens, const std::vector<int> &news)
{
    for (int hd : {32, 40, 64, 128})
        for (int G : {1, 8}) {
            const int nkv = 2, nh = nkv * G;
            const float scale = 0.0625f;
            const bool tuned = hd == 64 || hd == 128;
            Paged p = make_paged(lens, 3);
            const size_t cache_elems = (size_t)p.n_blocks * nkv * M40K_PAGE * hd;
            std::vector<uint16_t> kc(cache_elems), vc(cache_elems);
            for (size_t i = 0; i < cache_elems; i++)
                kc[i] = m40_fp32_to_fp16(frand(-2, 2)), vc[i] = m40_fp32_to_fp16(frand(-1, 1));
            std::vector<int32_t> new_indptr = {0}, row_seq, row_pos, dec_pos;
            for (size_t s = 0; s < news.size(); s++) {
                new_indptr.push_back(new_indptr.back() + news[s]);
                for (int i = 0; i < news[s]; i++)
                    row_seq.push_back((int)s), row_pos.push_back(lens[s] - news[s] + i);
                dec_pos.push_back(lens[s] - 1);
            }
            const int nt = new_indptr.back();
            const int64_t qs = nh * hd + 4, os = nh * hd + 8, kvs = nkv * hd;
            /* the decode kernel appends each sequence's last K/V row itself: these rows hold
             * the cache's values there, so the cache keeps its bits */
            std::vector<float> kn((size_t)p.n_seqs * kvs), vn((size_t)p.n_seqs * kvs);
            for (int s = 0; s < p.n_seqs; s++) {
                const int t = lens[s] - 1, blk = p.indices[p.indptr[s] + t / M40K_PAGE];
                for (int h = 0; h < nkv; h++)
                    for (int d = 0; d < hd; d++) {
                        const size_t at = (((size_t)blk * nkv + h) * M40K_PAGE + t % M40K_PAGE) * hd + d;
                        kn[(size_t)s * kvs + h * hd + d] = m40_fp16_to_fp32(kc[at]);
                        vn[(size_t)s * kvs + h * hd + d] = m40_fp16_to_fp32(vc[at]);
                    }
            }
            std::vector<float> sinks = rand_vec(nh, -3, 3);
            sinks[0] = 20.0f;
            uint16_t *dkc = dup(kc), *dvc = dup(vc);
            int32_t *dip = dup(p.indptr), *dix = dup(p.indices), *dlp = dup(p.lpl), *dni = dup(new_indptr);
            int32_t *drs = dup(row_seq), *drp = dup(row_pos), *ddp = dup(dec_pos);
            std::vector<float> q = rand_vec((size_t)nt * qs, -2, 2);
            float *dq = dup(q), *dsk = dup(sinks), *dkn = dup(kn), *dvn = dup(vn), *dout, *dws;
            CK(cudaMalloc(&dout, (size_t)nt * os * 4));
            CK(cudaMalloc(&dws, m40k_decode_workspace_floats(p.n_seqs, nh, hd, 64) * 4 + 64));
            const size_t n_cnt = m40k_decode_counter_ints(p.n_seqs, nkv);
            int *dcnt = dup(std::vector<int>(n_cnt, 0));
            char what[200];
            for (float cap : {0.0f, 0.7f})
                for (int window : {0, 5, 33})
                    for (int with : {1, 0}) {
                        const float *hs = with ? sinks.data() : nullptr, *ds = with ? dsk : nullptr;
                        if (tuned) {
                            /* decode: the first row of each sequence's queries as its one query */
                            std::vector<int32_t> one(p.n_seqs + 1);
                            for (int s = 0; s <= p.n_seqs; s++)
                                one[s] = s;
                            std::vector<float> c((size_t)p.n_seqs * os, 0.0f);
                            m40_ref_attn_prefill_sinks(c.data(), os, q.data(), qs, one.data(), p.n_seqs, p.n_seqs,
                                                       kc.data(), vc.data(), p.indptr.data(), p.indices.data(),
                                                       p.lpl.data(), nh, nkv, hd, scale, window, cap, hs);
                            for (int splits : {1, 3, 8, 40})
                                for (int rep = 0; rep < 2; rep++) {
                                    CK(cudaMemset(dout, 0, (size_t)nt * os * 4));
                                    CK(m40k_attn_decode_rope(dout, os, dq, qs, dkn, kvs, dvn, kvs, dkc, dvc, dip, dix,
                                                             dlp, p.n_seqs, nh, nkv, hd, scale, window, cap, ddp, 0,
                                                             10000.0f, nullptr, 1, splits, splits > 1 ? dws : nullptr,
                                                             splits > 1 ? dcnt : nullptr, dec_opts_q8(nullptr, ds), 0));
                                    std::vector<float> g = back(dout, c.size());
                                    snprintf(what, sizeof what,
                                             "decode sinks %d hd %d G %d seqs %d window %d cap %g splits %d call %d",
                                             with, hd, G, p.n_seqs, window, cap, splits, rep + 1);
                                    compare(what, g.data(), c.data(), c.size(), 2e-4f, 1e-3f);
                                }
                            std::vector<int> cnt = back(dcnt, n_cnt);
                            snprintf(what, sizeof what, "decode sinks hd %d G %d: counters left zero", hd, G);
                            check(what, std::all_of(cnt.begin(), cnt.end(), [](int v) { return v == 0; }));
                            /* prefill: every new row */
                            std::vector<float> pc((size_t)nt * os, 0.0f);
                            m40_ref_attn_prefill_sinks(pc.data(), os, q.data(), qs, new_indptr.data(), p.n_seqs, nt,
                                                       kc.data(), vc.data(), p.indptr.data(), p.indices.data(),
                                                       p.lpl.data(), nh, nkv, hd, scale, window, cap, hs);
                            CK(cudaMemset(dout, 0, (size_t)nt * os * 4));
                            CK(m40k_attn_prefill_sinks(dout, os, dq, qs, dni, p.n_seqs, nt, dkc, dvc, dip, dix, dlp,
                                                       nh, nkv, hd, scale, window, cap, ds, 0));
                            std::vector<float> g = back(dout, pc.size());
                            snprintf(what, sizeof what, "prefill simt sinks %d hd %d G %d window %d cap %g rows %d",
                                     with, hd, G, window, cap, nt);
                            compare(what, g.data(), pc.data(), pc.size(), 2e-4f, 1e-3f);
                            if (!with) { /* NULL sinks: the call without the suffix, bit for bit */
                                std::vector<float> a = g;
                                CK(cudaMemset(dout, 0, (size_t)nt * os * 4));
                                CK(m40k_attn_prefill_window(dout, os, dq, qs, dni, p.n_seqs, nt, dkc, dvc, dip, dix,
                                                            dlp, nh, nkv, hd, scale, window, cap, 0));
                                g = back(dout, pc.size());
                                snprintf(what, sizeof what, "prefill simt NULL sinks == window call hd %d G %d", hd, G);
                                check(what, memcmp(a.data(), g.data(), g.size() * 4) == 0);
                            }
                            if (m40k_attn_prefill_tc_supported(hd)) {
                                /* F16 Q and softmax weights: ~1e-3 of the output scale (kernels.h 7c) */
                                for (int S : {1, 2, 4}) {
                                    const size_t wsf = m40k_attn_prefill_split_ws_floats(nt, p.n_seqs, nh, nkv, hd, S);
                                    float *dpw = nullptr;
                                    CK(cudaMalloc(&dpw, wsf * 4 + 16));
                                    CK(cudaMemset(dout, 0, (size_t)nt * os * 4));
                                    CK(m40k_attn_prefill_tc_split_sinks(dout, os, dq, qs, dni, p.n_seqs, nt, dkc, dvc,
                                                                        dip, dix, dlp, nh, nkv, hd, scale, window, cap,
                                                                        S, S > 1 ? dpw : nullptr, ds, 0));
                                    g = back(dout, pc.size());
                                    snprintf(what, sizeof what,
                                             "prefill tc sinks %d hd %d G %d window %d cap %g splits %d", with, hd, G,
                                             window, cap, S);
                                    compare(what, g.data(), pc.data(), pc.size(), 4e-3f, 1e-2f);
                                    if (S == 2) { /* the auto pick takes the same path */
                                        std::vector<float> a = g;
                                        CK(cudaMemset(dout, 0, (size_t)nt * os * 4));
                                        CK(m40k_attn_prefill_auto_split_sinks(dout, os, dq, qs, dni, p.n_seqs, nt, dkc,
                                                                              dvc, dip, dix, dlp, nh, nkv, hd, scale,
                                                                              window, cap, S, dpw, ds, 0));
                                        g = back(dout, pc.size());
                                        snprintf(what, sizeof what, "auto_split == tc split sinks %d hd %d G %d", with,
                                                 hd, G);
                                        check(what, memcmp(a.data(), g.data(), g.size() * 4) == 0);
                                    }
                                    cudaFree(dpw);
                                }
                            }
                        }
                        /* generic: same rows, any head size */
                        std::vector<float> gc((size_t)nt * os, 0.0f);
                        m40_ref_attn_generic_sinks(gc.data(), os, q.data(), qs, row_seq.data(), row_pos.data(), nt,
                                                   kc.data(), vc.data(), p.indptr.data(), p.indices.data(), nh, nkv,
                                                   hd, scale, window, cap, hs);
                        CK(cudaMemset(dout, 0, (size_t)nt * os * 4));
                        CK(m40k_attn_generic_sinks(dout, os, dq, qs, drs, drp, nt, dkc, dvc, dip, dix, nh, nkv, hd,
                                                   scale, window, cap, ds, 0));
                        std::vector<float> g = back(dout, gc.size());
                        snprintf(what, sizeof what, "generic sinks %d hd %d G %d window %d cap %g rows %d", with, hd,
                                 G, window, cap, nt);
                        compare(what, g.data(), gc.data(), gc.size(), 2e-4f, 1e-3f);
                    }
            cudaFree(dq), cudaFree(dsk), cudaFree(dkn), cudaFree(dvn), cudaFree(dout), cudaFree(dws), cudaFree(dcnt),
                cudaFree(dkc), cudaFree(dvc), cudaFree(dip), cudaFree(dix), cudaFree(dlp), cudaFree(dni),
                cudaFree(drs), cudaFree(drp), cudaFree(ddp);
        }
}

/* the CPU twin's sink against the formula on a one-position context: out = v e^s / (e^s + e^sk) */
static void test_twin(void)
{
    const int hd = 8;
    std::vector<uint16_t> kc(M40K_PAGE * hd), vc(M40K_PAGE * hd);
    for (int d = 0; d < hd; d++)
        kc[d] = m40_fp32_to_fp16(d == 0 ? 1.0f : 0.0f), vc[d] = m40_fp32_to_fp16(1.0f + d);
    std::vector<int32_t> indptr = {0, 1}, indices = {0}, lpl = {1}, qi = {0, 1};
    std::vector<float> q(hd, 0.0f), out(hd);
    q[0] = 2.0f; /* score 2 (scale 1) */
    const float sk = 1.0f;
    m40_ref_attn_prefill_sinks(out.data(), hd, q.data(), hd, qi.data(), 1, 1, kc.data(), vc.data(), indptr.data(),
                               indices.data(), lpl.data(), 1, 1, hd, 1.0f, 0, 0.0f, &sk);
    const double w = exp(2.0) / (exp(2.0) + exp(1.0));
    bool ok = true;
    for (int d = 0; d < hd; d++)
        ok &= fabs(out[d] - w * (1.0 + d)) < 1e-5;
    check("twin: one position and a sink give v e^s / (e^s + e^sink)", ok);
}

int main(void)
{
    test_twin(); /* CPU only */
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        printf("SKIP: no CUDA device (%s)\n", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        printf("%d passed, %d failed, 1 skipped\n", n_pass, n_fail);
        return n_fail ? 1 : 0;
    }
    int p0 = n_pass, f0 = n_fail;
    test_sinks({1, 15, 17, 100, 700}, {1, 15, 3, 100, 37}); /* many sequences: workspace merges */
    test_sinks({300}, {20});                                 /* one: the cluster merge on sm_90 */
    printf("%-18s %d passed, %d failed\n", "sinks", n_pass - p0, n_fail - f0);
    printf("%d passed, %d failed, 0 skipped\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
