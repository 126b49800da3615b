/* Tensor-core prefill attention (kernels/attn_prefill_tc.cu) against its CPU twin
 * (m40_ref_attn_prefill_window, kernels/ref/cpu_ref.c) and the SIMT kernel on random inputs:
 * head dims 64/128/256, GQA groups 1/4/8 (and 7), new-token counts 1..513 after cached
 * prefixes 0..1000 (and few rows after contexts of up to 4,000 with the keys split 2..16
 * ways, kernels.h 7d), several sequences per batch on shuffled physical blocks whose unused
 * slots hold NaN bit patterns, odd strides, sharp softmax, sliding windows, Gemma 2's
 * soft-cap of the scores (with a check that the cap moves the twin's output by more
 * than the tolerance, so that a kernel ignoring it fails). Tolerance:
 * max abs error <= 2e-2 of the output scale (max |out|): Q and the softmax weights go
 * through F16 on the tensor cores.
 *   test_attn_tc          run the comparisons; ends with "N passed, N failed, N skipped"
 *   test_attn_tc --bench  also TFLOP/s of the tensor-core and the SIMT kernel for 512 new
 *                         tokens x 32 heads (8 KV heads) x head_dim 128, and variants
 * Without a GPU: prints why, "0 passed, 0 failed, 1 skipped", exit 0. Without sm_80 the
 * tensor-core checks are skipped and m40k_attn_prefill_auto is checked on its SIMT path. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <thread>
#include <vector>

extern "C" {
#include "ref/ggml_types.h"
#include "ref/quant.h"
}
#include "ref/cpu_ref.h"

#define GPU_CHECK_SEED 0xD1B54A32D192ED03ull
#include "gpu_check.h"

/* A batch: sequences of prefix[i] cached + news[i] new tokens on shuffled blocks. */
struct Batch {
    int n_seqs = 0, n_blocks = 0, n_rows = 0;
    std::vector<int32_t> indptr{0}, indices, lpl, q_indptr{0};
    std::vector<int> lens;
};
static Batch make_batch(const std::vector<int> &prefix, const std::vector<int> &news)
{
    Batch b;
    b.n_seqs = (int)news.size();
    int pages = 0;
    for (int i = 0; i < b.n_seqs; i++) {
        const int len = prefix[i] + news[i], np = (len + M40K_PAGE - 1) / M40K_PAGE;
        b.lens.push_back(len);
        pages += np;
        b.indptr.push_back(pages);
        b.lpl.push_back(len - (np - 1) * M40K_PAGE);
        b.q_indptr.push_back(b.q_indptr.back() + news[i]);
    }
    b.n_rows = b.q_indptr.back();
    b.n_blocks = pages + 7; /* spares, never referenced */
    std::vector<int32_t> perm(b.n_blocks);
    for (int i = 0; i < b.n_blocks; i++)
        perm[i] = i;
    for (int i = b.n_blocks - 1; i > 0; i--)
        std::swap(perm[i], perm[rnd32() % (i + 1)]);
    b.indices.assign(perm.begin(), perm.begin() + pages);
    return b;
}

/* F16 caches: random values in every used slot, NaN (0x7E00) everywhere else, so a
 * kernel that lets an unused slot reach its products shows it. */
static void fill_cache(const Batch &b, int nkv, int hd, std::vector<uint16_t> &kc, std::vector<uint16_t> &vc)
{
    const size_t elems = (size_t)b.n_blocks * nkv * M40K_PAGE * hd;
    kc.assign(elems, 0x7E00);
    vc.assign(elems, 0x7E00);
    for (int s = 0; s < b.n_seqs; s++)
        for (int t = 0; t < b.lens[s]; t++) {
            const size_t blk = (size_t)b.indices[b.indptr[s] + t / M40K_PAGE];
            for (int h = 0; h < nkv; h++) {
                const size_t at = ((blk * nkv + h) * M40K_PAGE + t % M40K_PAGE) * hd;
                for (int d = 0; d < hd; d++) {
                    kc[at + d] = m40_fp32_to_fp16(frand(-1, 1));
                    vc[at + d] = m40_fp32_to_fp16(frand(-1, 1));
                }
            }
        }
}

/* the CPU twin, one thread per sequence (offset CSR pointers: row indices stay absolute) */
static void cpu_prefill(float *out, int64_t os, const float *q, int64_t qs, const Batch &b, const uint16_t *kc,
                        const uint16_t *vc, int nh, int nkv, int hd, float scale, int window, float softcap)
{
    const unsigned nthr = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
    std::vector<std::thread> th;
    for (unsigned w = 0; w < nthr; w++)
        th.emplace_back([&, w] {
            for (int s = (int)w; s < b.n_seqs; s += (int)nthr)
                m40_ref_attn_prefill_window(out, os, q, qs, b.q_indptr.data() + s, 1, b.n_rows, kc, vc,
                                            b.indptr.data() + s, b.indices.data(), b.lpl.data() + s, nh, nkv, hd,
                                            scale, window, softcap);
        });
    for (auto &t : th)
        t.join();
}

static void check(bool ok, const char *what, const char *detail)
{
    if (ok)
        n_pass++;
    else
        n_fail++;
    printf("%s %s%s%s\n", ok ? "ok  " : "FAIL", what, detail[0] ? ": " : "", detail);
}

/* max |a - b| over the heads' columns; NaN counts as infinite. Padding columns (past
 * nh*hd in each row) must be exactly zero in a. */
static double max_err(const std::vector<float> &a, const std::vector<float> &b, int rows, int64_t stride, int width,
                      bool *pad_ok)
{
    double worst = 0;
    *pad_ok = true;
    for (int r = 0; r < rows; r++)
        for (int64_t i = 0; i < stride; i++) {
            const float x = a[r * stride + i];
            if (i >= width) {
                *pad_ok &= x == 0.0f;
                continue;
            }
            const double d = fabs((double)x - b[r * stride + i]);
            worst = std::max(worst, d != d ? INFINITY : d);
        }
    return worst;
}

struct Case {
    int hd, G, nkv;
    std::vector<int> prefix, news;
    int window = 0;
    int q_pad = 4, o_pad = 8; /* row strides nh*hd + pad (odd pads: unaligned rows) */
    float q_amp = 2.0f;       /* q in [-amp, amp]: larger = sharper softmax */
    std::vector<int> splits;  /* key-split counts to check (kernels.h 7d) besides the one-block kernel */
    float softcap = 0.0f;     /* of the scores (0: none) */
};

static void run_case(const Case &c, bool tc_ok)
{
    const int nh = c.G * c.nkv, hd = c.hd, width = nh * hd;
    const float scale = 1.0f / sqrtf((float)hd);
    Batch b = make_batch(c.prefix, c.news);
    std::vector<uint16_t> kc, vc;
    fill_cache(b, c.nkv, hd, kc, vc);
    const int64_t qs = width + c.q_pad, os = width + c.o_pad;
    const int rows = b.n_rows;
    std::vector<float> q(rows * qs);
    for (auto &x : q)
        x = frand(-c.q_amp, c.q_amp);
    std::vector<float> ref(rows * os, 0.0f);
    cpu_prefill(ref.data(), os, q.data(), qs, b, kc.data(), vc.data(), nh, c.nkv, hd, scale, c.window, c.softcap);
    double oscale = 1e-3;
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < width; i++)
            oscale = std::max(oscale, (double)fabsf(ref[r * os + i]));
    const double tol = 2e-2 * oscale;
    if (c.softcap > 0) { /* the cap must matter at this tolerance, or the case proves nothing */
        std::vector<float> plain(rows * os, 0.0f);
        cpu_prefill(plain.data(), os, q.data(), qs, b, kc.data(), vc.data(), nh, c.nkv, hd, scale, c.window, 0.0f);
        bool pad;
        const double moved = max_err(plain, ref, rows, os, width, &pad);
        char w[120], d[120];
        snprintf(w, sizeof w, "soft-cap %g moves the twin's output (hd %d G %d window %d)", c.softcap, hd, c.G,
                 c.window);
        snprintf(d, sizeof d, "by %.2e, tol %.2e", moved, tol);
        check(moved > 4 * tol, w, d);
    }

    uint16_t *dkc = dup(kc), *dvc = dup(vc);
    int32_t *dip = dup(b.indptr), *dix = dup(b.indices), *dlp = dup(b.lpl), *dqi = dup(b.q_indptr);
    float *dq = dup(q), *dout;
    const size_t on = (size_t)rows * os;
    CK(cudaMalloc(&dout, on * sizeof(float)));
    auto launch = [&](int which) { /* 0 tc, 1 simt, 2 auto */
        CK(cudaMemset(dout, 0, on * sizeof(float)));
        int e;
        if (which == 0)
            e = m40k_attn_prefill_tc_window(dout, os, dq, qs, dqi, b.n_seqs, rows, dkc, dvc, dip, dix, dlp, nh, c.nkv,
                                            hd, scale, c.window, c.softcap, 0);
        else if (which == 1)
            e = m40k_attn_prefill_window(dout, os, dq, qs, dqi, b.n_seqs, rows, dkc, dvc, dip, dix, dlp, nh, c.nkv, hd,
                                         scale, c.window, c.softcap, 0);
        else
            e = m40k_attn_prefill_auto_window(dout, os, dq, qs, dqi, b.n_seqs, rows, dkc, dvc, dip, dix, dlp, nh,
                                              c.nkv, hd, scale, c.window, c.softcap, 0);
        CK(e);
        return back(dout, on);
    };
    std::vector<float> simt = launch(1), autov = launch(2);

    char what[160], detail[200];
    int maxp = 0, maxn = 0;
    for (size_t i = 0; i < c.news.size(); i++)
        maxp = std::max(maxp, c.prefix[i]), maxn = std::max(maxn, c.news[i]);
    snprintf(what, sizeof what, "hd %d G %d nkv %d seqs %d rows %d (new <= %d, cached <= %d) window %d softcap %g%s%s",
             hd, c.G, c.nkv, b.n_seqs, rows, maxn, maxp, c.window, c.softcap, c.q_pad % 2 ? " odd strides" : "",
             c.q_amp > 2.0f ? " sharp" : "");
    bool pad_ok;
    const double e_simt = max_err(simt, ref, rows, os, width, &pad_ok);
    if (tc_ok) {
        std::vector<float> tc = launch(0);
        bool pad_tc;
        const double e_tc = max_err(tc, ref, rows, os, width, &pad_tc), e_ts = max_err(tc, simt, rows, os, width, &pad_tc);
        snprintf(detail, sizeof detail, "max err %.2e vs cpu, %.2e vs simt (simt vs cpu %.2e), tol %.2e", e_tc, e_ts,
                 e_simt, tol);
        char w2[200];
        snprintf(w2, sizeof w2, "tc %s", what);
        check(e_tc <= tol && e_ts <= tol && pad_tc, w2, detail);
        snprintf(w2, sizeof w2, "auto == tc %s", what);
        check(memcmp(autov.data(), tc.data(), on * sizeof(float)) == 0, w2, "");
        /* 7f: the F16 output is the F32 one rounded, bit for bit, one block and split
         * (the merge kernel writes it there) */
        auto same_h16 = [&](const std::vector<float> &f, int S, float *dws) {
            uint16_t *dh = nullptr;
            CK(cudaMalloc(&dh, on * sizeof(uint16_t)));
            CK(cudaMemset(dh, 0, on * sizeof(uint16_t)));
            CK(m40k_attn_prefill_tc_split_sinks_h16(dh, os, dq, qs, dqi, b.n_seqs, rows, dkc, dvc, dip, dix, dlp, nh,
                                                    c.nkv, hd, scale, c.window, c.softcap, S, dws, nullptr, 0));
            std::vector<uint16_t> h = back(dh, on);
            size_t diff = 0;
            for (int r = 0; r < rows; r++)
                for (int i = 0; i < width; i++)
                    diff += h[(size_t)r * os + i] != m40_fp32_to_fp16(f[(size_t)r * os + i]);
            char w3[200];
            snprintf(w3, sizeof w3, "tc_h16 (%d splits) == F16 of tc %s", S, what);
            char d3[64];
            snprintf(d3, sizeof d3, "%zu outputs differ", diff);
            check(diff == 0, w3, d3);
            cudaFree(dh);
        };
        same_h16(tc, 1, nullptr);
        for (int S : c.splits) {
            const size_t wsf = m40k_attn_prefill_split_ws_floats(rows, b.n_seqs, nh, c.nkv, hd, S);
            float *dws = nullptr;
            CK(cudaMalloc(&dws, wsf * sizeof(float) + 16));
            CK(cudaMemset(dws, 0xFF, wsf * sizeof(float) + 16)); /* NaN: a record read before written shows */
            CK(cudaMemset(dout, 0, on * sizeof(float)));
            CK(m40k_attn_prefill_tc_split(dout, os, dq, qs, dqi, b.n_seqs, rows, dkc, dvc, dip, dix, dlp, nh, c.nkv, hd,
                                          scale, c.window, c.softcap, S, dws, 0));
            std::vector<float> sv = back(dout, on);
            bool pad_s;
            const double e_s = max_err(sv, ref, rows, os, width, &pad_s), e_st = max_err(sv, tc, rows, os, width, &pad_s);
            snprintf(detail, sizeof detail, "max err %.2e vs cpu, %.2e vs one block, tol %.2e", e_s, e_st, tol);
            snprintf(w2, sizeof w2, "tc %d key splits %s", S, what);
            check(e_s <= tol && e_st <= 1e-3 * oscale && pad_s, w2, detail);
            same_h16(sv, S, dws);
            cudaFree(dws);
        }
        if (!c.splits.empty()) { /* the auto call with splits takes the same path */
            const int S = c.splits.back();
            const size_t wsf = m40k_attn_prefill_split_ws_floats(rows, b.n_seqs, nh, c.nkv, hd, S);
            float *dws = nullptr;
            CK(cudaMalloc(&dws, wsf * sizeof(float) + 16));
            CK(cudaMemset(dout, 0, on * sizeof(float)));
            CK(m40k_attn_prefill_tc_split(dout, os, dq, qs, dqi, b.n_seqs, rows, dkc, dvc, dip, dix, dlp, nh, c.nkv, hd,
                                          scale, c.window, c.softcap, S, dws, 0));
            std::vector<float> a = back(dout, on);
            CK(cudaMemset(dout, 0, on * sizeof(float)));
            CK(m40k_attn_prefill_auto_split(dout, os, dq, qs, dqi, b.n_seqs, rows, dkc, dvc, dip, dix, dlp, nh, c.nkv,
                                            hd, scale, c.window, c.softcap, S, dws, 0));
            std::vector<float> a2 = back(dout, on);
            snprintf(w2, sizeof w2, "auto_split == tc_split (%d) %s", S, what);
            check(memcmp(a.data(), a2.data(), on * sizeof(float)) == 0, w2, "");
            cudaFree(dws);
        }
    } else {
        snprintf(detail, sizeof detail, "max err %.2e vs cpu (simt path), tol %.2e", e_simt, tol);
        char w2[200];
        snprintf(w2, sizeof w2, "auto == simt %s", what);
        check(memcmp(autov.data(), simt.data(), on * sizeof(float)) == 0 && e_simt <= tol && pad_ok, w2, detail);
    }
    cudaFree(dkc), cudaFree(dvc), cudaFree(dip), cudaFree(dix), cudaFree(dlp), cudaFree(dqi), cudaFree(dq),
        cudaFree(dout);
}

static void test_prefill_tc(bool tc_ok)
{
    const std::vector<int> news = {1, 15, 16, 17, 100, 513}, prefixes = {0, 5, 16, 1000};
    /* every (head dim, group): all new-token counts, prefixes rotated so that every
     * (new, prefix) pair turns up across the cases */
    int rot = 0;
    for (int hd : {64, 128, 256})
        for (int G : {1, 4, 8}) {
            Case c;
            c.hd = hd, c.G = G, c.nkv = G == 8 ? 1 : 2;
            c.news = news;
            for (size_t i = 0; i < news.size(); i++)
                c.prefix.push_back(prefixes[(i + rot) % prefixes.size()]);
            rot++;
            run_case(c, tc_ok);
        }
    /* odd strides (scalar Q loads and output stores), G 7, a sharp softmax */
    {
        Case c;
        c.hd = 64, c.G = 4, c.nkv = 2, c.news = {17, 100, 1}, c.prefix = {5, 16, 1000}, c.q_pad = 3, c.o_pad = 5;
        run_case(c, tc_ok);
        c.G = 7, c.nkv = 1, c.q_pad = 4, c.o_pad = 8;
        run_case(c, tc_ok);
        c.hd = 128, c.G = 4, c.nkv = 2, c.news = {513, 16}, c.prefix = {16, 1000}, c.q_amp = 8.0f;
        run_case(c, tc_ok);
    }
    /* sliding windows, from 1 token to longer than the context */
    {
        const struct { int hd, G, window; } w[] = {{64, 8, 1}, {64, 1, 16}, {128, 4, 100}, {256, 4, 37}, {128, 1, 700}, {64, 4, 5000}};
        for (auto &x : w) {
            Case c;
            c.hd = x.hd, c.G = x.G, c.nkv = 2, c.window = x.window;
            c.news = {513, 17, 100, 1}, c.prefix = {1000, 16, 5, 1000};
            run_case(c, tc_ok);
        }
    }
    /* Gemma 2's soft-cap of the scores, every head dim, with and without a window, odd
     * strides and counts; q_amp 8 makes the scores reach several units, so a cap of 1.5
     * bends them (Gemma 2's own 50 would barely move random scores) */
    {
        const struct { int hd, G, window; } w[] = {{64, 4, 0}, {128, 2, 37}, {256, 4, 0}, {256, 1, 100}, {128, 8, 5000}};
        for (auto &x : w) {
            Case c;
            c.hd = x.hd, c.G = x.G, c.nkv = x.G == 8 ? 1 : 2, c.window = x.window, c.softcap = 1.5f, c.q_amp = 8.0f;
            c.news = {513, 17, 100, 1}, c.prefix = {1000, 16, 5, 1000}, c.q_pad = 3, c.o_pad = 5;
            run_case(c, tc_ok);
        }
    }
    /* many short sequences: the block-to-sequence scan */
    {
        Case c;
        c.hd = 128, c.G = 4, c.nkv = 2;
        for (int i = 0; i < 40; i++) {
            c.news.push_back(1 + (int)(rnd32() % 40));
            c.prefix.push_back((int)(rnd32() % 81));
        }
        run_case(c, tc_ok);
    }
    /* key splits: few new rows after long contexts (and the one-block kernel's shapes),
     * splits of 2..16 incl. ones with no keys (more splits than key tiles), windows */
    {
        const struct { int hd, G, nkv, window; std::vector<int> prefix, news, splits; float softcap; } sc[] = {
            {128, 4, 2, 0, {4000, 2500, 0}, {16, 3, 5}, {2, 3, 16}},
            {128, 4, 2, 0, {3000, 900}, {16, 3}, {5, 16}, 1.5f},
            {256, 2, 2, 100, {2000, 50}, {7, 30}, {3}, 1.5f},
            {64, 8, 1, 0, {3001, 10}, {1, 40}, {7, 16}},
            {256, 2, 2, 0, {2047, 700}, {17, 1}, {5, 16}},
            {128, 4, 2, 300, {4000, 1000}, {16, 100}, {4, 16}},
            {64, 1, 2, 1, {600, 5}, {9, 2}, {3}},
            {128, 4, 2, 0, {1000, 16}, {513, 100}, {2, 9}},
        };
        for (auto &x : sc) {
            Case c;
            c.hd = x.hd, c.G = x.G, c.nkv = x.nkv, c.window = x.window, c.prefix = x.prefix, c.news = x.news;
            c.splits = x.splits;
            if (x.softcap > 0)
                c.softcap = x.softcap, c.q_amp = 8.0f;
            run_case(c, tc_ok);
        }
        /* the picker: no split for a full chunk or a short context; two waves for a few rows */
        const int p512 = m40k_attn_prefill_pick_splits(512, 1, 32, 8, 128, 8192, 132, (size_t)16 << 20);
        const int p16 = m40k_attn_prefill_pick_splits(16, 1, 32, 8, 128, 8192, 132, (size_t)16 << 20);
        const int pshort = m40k_attn_prefill_pick_splits(16, 1, 32, 8, 128, 700, 132, (size_t)16 << 20);
        const int ptight = m40k_attn_prefill_pick_splits(16, 1, 32, 8, 128, 100000, 132,
                                                         m40k_attn_prefill_split_ws_floats(16, 1, 32, 8, 128, 3));
        char d[160];
        snprintf(d, sizeof d, "512 rows at 8k: %d, 16 rows at 8k: %d, 16 rows at 700: %d, 16 rows, ws for 3: %d", p512,
                 p16, pshort, ptight);
        check(p512 == 1 && p16 == 16 && pshort == 1 && ptight == 3, "prefill split picker", d);
    }
    /* argument checks match the SIMT wrapper's */
    if (tc_ok) {
        const int bad_g = m40k_attn_prefill_tc(nullptr, 0, nullptr, 0, nullptr, 1, 1, nullptr, nullptr, nullptr,
                                               nullptr, nullptr, 18, 2, 128, 1.0f, 0);
        const int bad_d = m40k_attn_prefill_tc(nullptr, 0, nullptr, 0, nullptr, 1, 1, nullptr, nullptr, nullptr,
                                               nullptr, nullptr, 8, 2, 96, 1.0f, 0);
        const int empty = m40k_attn_prefill_tc(nullptr, 0, nullptr, 0, nullptr, 0, 0, nullptr, nullptr, nullptr,
                                               nullptr, nullptr, 8, 2, 128, 1.0f, 0);
        check(bad_g == (int)cudaErrorInvalidValue && bad_d == (int)cudaErrorInvalidValue && empty == 0,
              "tc argument checks (G 9, head_dim 96, empty batch)", "");
    }
}

/* ---------------------------------------------------------------- bench */
static void bench(bool tc_ok)
{
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int hd = 128, nh = 32, nkv = 8;
    const float scale = 1.0f / sqrtf((float)hd);
    const struct { const char *name; int n_seqs, prefix, news; } shapes[] = {
        {"1 seq x 512 new", 1, 0, 512},
        {"1 seq x 512 new after 3584", 1, 3584, 512},
        {"8 seqs x 512 new", 8, 0, 512},
        {"1 seq x 4096 new", 1, 0, 4096},
        {"1 seq x 16 new after 16384", 1, 16384, 16},
        {"1 seq x 64 new after 94000", 1, 94000, 64},
    };
    printf("bench attn_prefill on %s: 32 heads, 8 KV heads, head_dim 128 (flops = 4*hd*heads*sum of visible tokens)\n",
           prop.name);
    for (auto &sh : shapes) {
        Batch b = make_batch(std::vector<int>(sh.n_seqs, sh.prefix), std::vector<int>(sh.n_seqs, sh.news));
        std::vector<uint16_t> kc, vc;
        fill_cache(b, nkv, hd, kc, vc);
        const int64_t qs = nh * hd, os = nh * hd;
        std::vector<float> q(b.n_rows * qs);
        for (auto &x : q)
            x = frand(-2, 2);
        double visible = 0;
        for (int s = 0; s < b.n_seqs; s++)
            for (int i = 0; i < sh.news; i++)
                visible += sh.prefix + i + 1;
        const double flops = 4.0 * hd * nh * visible;
        uint16_t *dkc = dup(kc), *dvc = dup(vc);
        int32_t *dip = dup(b.indptr), *dix = dup(b.indices), *dlp = dup(b.lpl), *dqi = dup(b.q_indptr);
        float *dq = dup(q), *dout;
        CK(cudaMalloc(&dout, (size_t)b.n_rows * os * sizeof(float)));
        double us[2] = {0, 0};
        for (int which = 0; which < 2; which++) {
            if (which == 0 && !tc_ok)
                continue;
            auto run = [&] {
                if (which == 0)
                    CK(m40k_attn_prefill_tc(dout, os, dq, qs, dqi, b.n_seqs, b.n_rows, dkc, dvc, dip, dix, dlp, nh,
                                            nkv, hd, scale, 0));
                else
                    CK(m40k_attn_prefill(dout, os, dq, qs, dqi, b.n_seqs, b.n_rows, dkc, dvc, dip, dix, dlp, nh, nkv,
                                         hd, scale, 0));
            };
            us[which] = time_us(run, 20);
        }
        double us_kh[2] = {0, 0}; /* one key half a block, two */
        if (tc_ok)
            for (int kh = 1; kh <= 2; kh++) {
                m40k_attn_prefill_tc_tune(kh);
                us_kh[kh - 1] = time_us([&] { CK(m40k_attn_prefill_tc(dout, os, dq, qs, dqi, b.n_seqs, b.n_rows, dkc, dvc, dip, dix, dlp, nh, nkv, hd, scale, 0)); }, 20);
                m40k_attn_prefill_tc_tune(0);
            }
        double us_split = 0;
        int S = 1;
        if (tc_ok) {
            S = m40k_attn_prefill_pick_splits(b.n_rows, b.n_seqs, nh, nkv, hd, sh.prefix + sh.news,
                                              prop.multiProcessorCount, (size_t)16 << 20);
            if (S > 1) {
                float *dws;
                CK(cudaMalloc(&dws, m40k_attn_prefill_split_ws_floats(b.n_rows, b.n_seqs, nh, nkv, hd, S) * 4 + 16));
                us_split = time_us([&] { CK(m40k_attn_prefill_tc_split(dout, os, dq, qs, dqi, b.n_seqs, b.n_rows, dkc, dvc, dip, dix, dlp, nh, nkv, hd, scale, 0, 0.0f, S, dws, 0)); }, 20);
                cudaFree(dws);
            }
        }
        if (us_split > 0)
            printf("bench attn_prefill %-28s %d key splits: %8.1f us %6.1f TFLOP/s (one block a tile: %.1f us)\n",
                   sh.name, S, us_split, flops / (us_split * 1e6), us[0]);
        if (tc_ok)
            printf("bench attn_prefill %-28s key halves 1 / 2: %8.1f / %8.1f us\n", sh.name, us_kh[0], us_kh[1]);
        const double t_tc = us[0] > 0 ? flops / (us[0] * 1e6) : 0, t_simt = flops / (us[1] * 1e6);
        printf("bench attn_prefill %-28s %6.2f GFLOP: tc %8.1f us %6.1f TFLOP/s | simt %8.1f us %6.1f TFLOP/s | "
               "tc/simt %.1fx\n",
               sh.name, flops * 1e-9, us[0], t_tc, us[1], t_simt, us[0] > 0 ? us[1] / us[0] : 0.0);
        cudaFree(dkc), cudaFree(dvc), cudaFree(dip), cudaFree(dix), cudaFree(dlp), cudaFree(dqi), cudaFree(dq),
            cudaFree(dout);
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
    const bool want_bench = argc > 1 && strcmp(argv[1], "--bench") == 0;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const bool tc_ok = m40k_attn_prefill_tc_supported(64) && m40k_attn_prefill_tc_supported(128) &&
                       m40k_attn_prefill_tc_supported(256);
    if (!tc_ok) {
        printf("SKIP: tensor-core prefill not supported on %s (sm_%d%d; supported hd 64/128/256: %d/%d/%d); "
               "checking the auto dispatcher's SIMT path\n",
               prop.name, prop.major, prop.minor, m40k_attn_prefill_tc_supported(64),
               m40k_attn_prefill_tc_supported(128), m40k_attn_prefill_tc_supported(256));
        n_skip++;
        if (prop.major >= 8) {
            /* on sm_80+ the path must be there: a build without an sm_80+ image is a failure */
            printf("FAIL tensor-core path unavailable on an sm_%d%d device\n", prop.major, prop.minor);
            n_fail++;
        }
    }
    /* the default, then each block shape on every case (two key halves: head_dim 64 and
     * 128; 256 keeps one) */
    for (int kh : {0, 1, 2}) {
        m40k_attn_prefill_tc_tune(kh);
        printf("key halves: %s\n", kh ? (kh == 1 ? "1" : "2") : "default");
        test_prefill_tc(tc_ok);
    }
    m40k_attn_prefill_tc_tune(0);
    if (want_bench)
        bench(tc_ok);
    printf("%d passed, %d failed, %d skipped\n", n_pass, n_fail, n_skip);
    return n_fail ? 1 : 0;
}
