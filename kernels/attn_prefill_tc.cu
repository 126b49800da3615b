/* Prefill attention over the paged cache on tensor cores (sm_80 and newer): causal,
 * optional sliding window, flash-attention-2 style. Same arguments and results as the
 * SIMT kernel in attn_prefill.cu (m40k_attn_prefill[_window]); m40k_attn_prefill_auto
 * picks this one where it runs and the SIMT one elsewhere.
 *
 * A block (4 warps) owns BM = 64 query rows of one sequence and one KV head; a row is
 * (token, head of the group) as in the SIMT kernel, so the G query heads sharing a KV
 * head share every K/V tile. Each warp owns 16 rows. For head_dim 64 and 128 the block
 * has 8 warps in two key halves (tc_kh2): warps w and w + 4 own the same rows and walk
 * alternate key tiles with K/V buffers and barriers of their own, and their softmax
 * states merge at the end. Per KV tile of BN tokens (64, or 32 for head_dim 256):
 *   - K and V rows are gathered page by page (block table) into shared memory with
 *     cp.async, F16 as stored; V(j) is fetched while S = Q K(j)^T is computed and
 *     K(j+1) while P V(j) is, so one buffer of each suffices (smem 27/51/66 KB);
 *   - S = Q K^T by mma.sync.m16n8k16 (F16 in, F32 accumulate), Q (pre-scaled by
 *     scale*log2(e), rounded to F16 once) and K fragments read with ldmatrix;
 *   - with softcap > 0 (Gemma 2) the scores are capped on the accumulator registers
 *     before the mask: in the log2 domain Q carries, c * tanh(s / c) of s = scale q.k
 *     is c2 * tanh(s2 / c2) with s2 = log2(e) s and c2 = log2(e) c (a uniform branch);
 *   - online softmax on the accumulator registers (exp2, row max/sum over the 4 lanes
 *     of a quad), causal/window mask only on tiles that cross a boundary;
 *   - the accumulator layout of S is the A-operand layout of P, so P goes to F16 in
 *     registers and O += P V runs on mma.sync too (V fragments by ldmatrix.trans);
 *   - O stays in F32 registers and is divided by the row sum at the end.
 * K/V tokens past the last visible position are zero-filled (cp.async src-size 0) so
 * stale cache slots (possibly NaN bit patterns) never reach the products. A warp whose
 * rows see nothing of a tile skips its math (it still joins the barriers).
 * Precision: Q and P are rounded to F16 (K and V are F16 already), sums are F32: errors
 * of ~1e-3 relative to the output scale, against ~1e-6 for the SIMT kernel.
 *
 * Key splits (m40k_attn_prefill_tc_split): a few new tokens after a long context (a
 * long prompt in chunks, a prompt while others stream) make few (tile, KV head) blocks,
 * each walking the whole context while most SMs idle. With n_splits > 1 blockIdx.z
 * takes one range of whole key tiles, writes its rows' unnormalized O, max and sum to a
 * workspace, and a second kernel merges the splits (flash-decoding's reduction).
 *
 * Blocks map to (sequence, row tile) by a scan over q_indptr as in the SIMT kernel;
 * inside a sequence the last (most expensive, causally) tiles get the lowest block
 * numbers so they start first. The mma path is compiled for __CUDA_ARCH__ >= 800 only;
 * the wrapper refuses to launch where the loaded kernel image is older (sm_75 builds,
 * or a PTX-JIT of one), checked from cudaFuncGetAttributes. */
#include "cuda_common.h"

#include <atomic>
#include <math.h>

#define TC_THREADS 128
#define TC_BM 64

template <int D> struct tc_cfg {
    enum { BN = D == 256 ? 32 : 64, LDS = D + 8 /* F16 row stride in smem: +16 bytes against ldmatrix bank conflicts */ };
    static constexpr size_t smem = sizeof(uint16_t) * (size_t)(TC_BM + 2 * BN) * LDS;
    /* with the block's keys in two halves (KH 2): a K and V buffer each */
    static constexpr size_t smem2 = sizeof(uint16_t) * (size_t)(TC_BM + 4 * BN) * LDS;
};
/* Key halves: KH 2 runs 8 warps a block, warps w and w + 4 own the same 16 rows and take
 * alternate key tiles, their partial softmax states merged through shared memory at the
 * end (half 1's K/V buffers: exactly its accumulators' size for head_dim 64 and 128,
 * which alone take it). A prompt chunk's causal critical path is its last row tile's
 * walk over every key; two halves walk it in half the steps. */
template <int D> struct tc_kh2 {
    enum { OK = D <= 128 };
    static_assert(!OK || 2 * tc_cfg<D>::BN * tc_cfg<D>::LDS * 2 == (D / 2 + 4) * 128 * 4,
                  "half 1's K/V buffers hold its accumulators exactly");
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
/* the barrier of one key half's 4 warps (KH 2), or of the block (KH 1) */
template <int KH> __device__ __forceinline__ void tc_bar(int kh)
{
    if constexpr (KH == 1)
        __syncthreads();
    else if (kh) /* immediate ids: a register id makes ptxas reserve all 16 barriers */
        asm volatile("bar.sync 2, 128;\n" ::: "memory");
    else
        asm volatile("bar.sync 1, 128;\n" ::: "memory");
}
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ uint32_t tc_smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* 16 bytes global -> shared, asynchronously; src_bytes 0 writes zeros and reads nothing */
__device__ __forceinline__ void tc_cp_async16(void *dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(tc_smem_addr(dst)), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void tc_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void tc_cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void tc_ldmatrix_x4(uint32_t r[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(tc_smem_addr(p)));
}
__device__ __forceinline__ void tc_ldmatrix_x4_trans(uint32_t r[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(tc_smem_addr(p)));
}

/* c[16x8] += a[16x16] b[16x8]; F16 inputs, F32 accumulator. Fragment layouts (g = lane/4,
 * t = lane%4): a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..);
 * b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g); c0,c1 (g, 2t..2t+1), c2,c3 (g+8, 2t..). */
__device__ __forceinline__ void tc_mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#endif

/* (sequence, row tile) of block blockIdx.x, by a scan over q_indptr; the last (most
 * expensive, causally) tile of a sequence first. -1: a block past the last tile. */
__device__ __forceinline__ int tc_find_tile(const int32_t *__restrict__ q_indptr, int n_seqs, int G, int *tile_out)
{
    int tile = blockIdx.x;
    for (int i = 0; i < n_seqs; i++) {
        const int nt = ((q_indptr[i + 1] - q_indptr[i]) * G + TC_BM - 1) / TC_BM;
        if (tile < nt) {
            *tile_out = nt - 1 - tile;
            return i;
        }
        tile -= nt;
    }
    return -1;
}

/* the output's element type: float, or uint16_t for F16 (the _h16 call) */
__device__ __forceinline__ void tc_store2(float *dst, float x, float y, bool vec)
{
    if (vec) {
        *reinterpret_cast<float2 *>(dst) = make_float2(x, y);
    } else {
        dst[0] = x;
        dst[1] = y;
    }
}
__device__ __forceinline__ void tc_store2(uint16_t *dst, float x, float y, bool vec)
{
    if (vec) {
        *reinterpret_cast<uint32_t *>(dst) = m40k_pack_h2(x, y);
    } else {
        dst[0] = m40k_f2h(x);
        dst[1] = m40k_f2h(y);
    }
}
__device__ __forceinline__ void tc_store1(float *dst, float x) { *dst = x; }
__device__ __forceinline__ void tc_store1(uint16_t *dst, float x) { *dst = m40k_f2h(x); }

template <int D, typename OT, int KH>
__global__ __launch_bounds__(TC_THREADS *KH, KH == 2 ? 2 : 1) void attn_prefill_tc_kernel(
    OT *__restrict__ out, int64_t out_stride, const float *__restrict__ q, int64_t q_stride,
    const int32_t *__restrict__ q_indptr, int n_seqs, const uint16_t *__restrict__ kc, const uint16_t *__restrict__ vc,
    const int32_t *__restrict__ indptr, const int32_t *__restrict__ indices, const int32_t *__restrict__ last_page_len,
    int n_heads, int n_kv_heads, float scale_log2, int window, float softcap_log2, int n_splits,
    float *__restrict__ ws, const float *__restrict__ sinks)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int BN = tc_cfg<D>::BN, LDS = tc_cfg<D>::LDS;
    extern __shared__ __align__(16) uint16_t tc_smem[];
    const int G = n_heads / n_kv_heads, kvh = blockIdx.y, tid = threadIdx.x;
    /* warp: this warp's 16 rows (0..3); kh: its key half; htid: its thread in the half */
    const int lane = tid & 31, warp = (tid >> 5) & 3, kh = KH == 2 ? tid >> 7 : 0, htid = tid & 127;
    const int g = lane >> 2, tig = lane & 3;
    uint16_t *Qs = tc_smem;                               /* [BM][LDS] */
    uint16_t *Ks = Qs + TC_BM * LDS + kh * 2 * BN * LDS; /* [BN][LDS], the half's */
    uint16_t *Vs = Ks + BN * LDS;                         /* [BN][LDS] */

    int tile;
    const int s = tc_find_tile(q_indptr, n_seqs, G, &tile);
    if (s < 0)
        return;
    const int q0 = q_indptr[s], nq = q_indptr[s + 1] - q0;
    const int page0 = indptr[s], npages = indptr[s + 1] - page0;
    const int len = npages > 0 ? (npages - 1) * M40K_PAGE + last_page_len[s] : 0;
    const int row0 = tile * TC_BM, nrows = min(TC_BM, nq * G - row0);
    /* row r: token q0 + (row0 + r) / G at position base + (row0 + r) / G, head kvh*G + (row0 + r) % G */
    const int base = len - nq;
    const int first_pos = base + row0 / G, last_pos = base + (row0 + nrows - 1) / G;
    const int kv_end = min(len, last_pos + 1);
    /* whole pairs of tiles under two key halves: a tile's half is then the parity of its
     * absolute index, so a row's sums do not depend on where its query tile starts (a
     * prompt cut into other chunks gets the same bits: the engine's batch invariance) */
    const int kv_begin = window > 0 ? max(0, first_pos - window + 1) / (KH * BN) * (KH * BN) : 0;
    /* key split blockIdx.z of n_splits: whole BN tiles of [kv_begin, kv_end) */
    int my_begin = kv_begin, my_end = kv_end;
    if (n_splits > 1) {
        const int per = ((kv_end - kv_begin + BN - 1) / BN + n_splits - 1) / n_splits * BN;
        my_begin = min(kv_end, kv_begin + (int)blockIdx.z * per);
        my_end = min(kv_end, my_begin + per);
    }

    /* Q tile: F32 -> * scale*log2(e) -> F16; rows past nrows are zeros (never written out) */
    {
        const bool vec = (q_stride & 3) == 0 && (reinterpret_cast<uintptr_t>(q) & 15) == 0;
        for (int i = tid; i < TC_BM * D / 4; i += TC_THREADS * KH) {
            const int r = i / (D / 4), c = 4 * (i % (D / 4));
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (r < nrows) {
                const int row = row0 + r;
                const float *src = q + (int64_t)(q0 + row / G) * q_stride + (int64_t)(kvh * G + row % G) * D + c;
                v = vec ? __ldg(reinterpret_cast<const float4 *>(src))
                        : make_float4(__ldg(src), __ldg(src + 1), __ldg(src + 2), __ldg(src + 3));
            }
            uint2 h;
            h.x = m40k_pack_h2(v.x * scale_log2, v.y * scale_log2);
            h.y = m40k_pack_h2(v.z * scale_log2, v.w * scale_log2);
            *reinterpret_cast<uint2 *>(Qs + r * LDS + c) = h;
        }
        if constexpr (KH == 2)
            __syncthreads(); /* the Q tile, written by both halves (each half's barriers are its own) */
    }

    /* K or V rows kv0 .. kv0+BN of this KV head into dst, zeros past kv_end */
    auto load_tile = [&](uint16_t *dst, const uint16_t *__restrict__ cache, int kv0) {
        constexpr int CH = D / 8; /* 16-byte chunks per token */
        for (int i = htid; i < BN * CH; i += TC_THREADS) {
            const int n = i / CH, c = i % CH, t = kv0 + n;
            const uint16_t *src = cache;
            int bytes = 0;
            if (t < kv_end) {
                const int64_t blk = __ldg(indices + page0 + t / M40K_PAGE);
                src = cache + (((size_t)blk * n_kv_heads + kvh) * M40K_PAGE + t % M40K_PAGE) * D + 8 * c;
                bytes = 16;
            }
            tc_cp_async16(dst + n * LDS + 8 * c, src, bytes);
        }
    };

    /* this warp's rows: wr0 .. wr0+15; this lane's rows wr0+g (index 0) and wr0+g+8 (index 1) */
    const int wr0 = warp * 16;
    const int pos0 = base + (row0 + wr0 + g) / G, pos1 = base + (row0 + wr0 + g + 8) / G;
    const int wfirst = base + (row0 + wr0) / G, wlast = base + (row0 + wr0 + 15) / G;

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++)
        o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f; /* l: this lane's partial row sums */

    /* key half kh takes tiles my_begin + (KH j + kh) BN */
    if (my_begin + kh * BN < my_end)
        load_tile(Ks, kc, my_begin + kh * BN);
    tc_cp_async_commit();
    for (int kv0 = my_begin + kh * BN; kv0 < my_end; kv0 += KH * BN) {
        load_tile(Vs, vc, kv0);
        tc_cp_async_commit();
        tc_cp_async_wait<1>(); /* this thread's K(j) */
        tc_bar<KH>(kh);        /* everyone's K(j) (and the Q tile) */

        /* does any (real) row of this warp see a token of the tile? */
        const bool active = wr0 < nrows && kv0 <= wlast && (window <= 0 || kv0 + BN - 1 > wfirst - window);
        float sc[BN / 8][4];
        if (active) {
#pragma unroll
            for (int j = 0; j < BN / 8; j++)
                sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                uint32_t a[4];
                tc_ldmatrix_x4(a, Qs + (wr0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * LDS + kk * 16 + 8 * (lane >> 4));
#pragma unroll
                for (int jp = 0; jp < BN / 16; jp++) {
                    uint32_t b[4];
                    tc_ldmatrix_x4(b, Ks + (jp * 16 + (lane & 7) + 8 * (lane >> 4)) * LDS + kk * 16 +
                                          8 * ((lane >> 3) & 1));
                    tc_mma(sc[2 * jp], a, b[0], b[1]);
                    tc_mma(sc[2 * jp + 1], a, b[2], b[3]);
                }
            }
            if (softcap_log2 > 0.0f) /* before the mask: masked scores become -inf after it */
#pragma unroll
                for (int j = 0; j < BN / 8; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        sc[j][e] = softcap_log2 * tanhf(sc[j][e] / softcap_log2);
            /* mask: token t visible to a row at p when p - window < t <= p */
            if (kv0 + BN - 1 > wfirst || (window > 0 && kv0 <= wlast - window)) {
                const int lo0 = window > 0 ? pos0 - window : -1, lo1 = window > 0 ? pos1 - window : -1;
#pragma unroll
                for (int j = 0; j < BN / 8; j++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int t = kv0 + 8 * j + 2 * tig + e;
                        if (t > pos0 || t <= lo0)
                            sc[j][e] = -INFINITY;
                        if (t > pos1 || t <= lo1)
                            sc[j][2 + e] = -INFINITY;
                    }
            }
            /* online softmax (log2 domain: Q carries log2(e)) */
            float mx0 = m0, mx1 = m1;
#pragma unroll
            for (int j = 0; j < BN / 8; j++) {
                mx0 = fmaxf(mx0, fmaxf(sc[j][0], sc[j][1]));
                mx1 = fmaxf(mx1, fmaxf(sc[j][2], sc[j][3]));
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            /* a row that has seen only masked scores keeps m = -inf: shift by 0 then */
            const float sh0 = mx0 == -INFINITY ? 0.0f : mx0, sh1 = mx1 == -INFINITY ? 0.0f : mx1;
            const float al0 = exp2f(m0 - sh0), al1 = exp2f(m1 - sh1);
            m0 = mx0, m1 = mx1;
            float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
            for (int j = 0; j < BN / 8; j++) {
                sc[j][0] = exp2f(sc[j][0] - sh0);
                sc[j][1] = exp2f(sc[j][1] - sh0);
                sc[j][2] = exp2f(sc[j][2] - sh1);
                sc[j][3] = exp2f(sc[j][3] - sh1);
                rs0 += sc[j][0] + sc[j][1];
                rs1 += sc[j][2] + sc[j][3];
            }
            l0 = l0 * al0 + rs0;
            l1 = l1 * al1 + rs1;
#pragma unroll
            for (int i = 0; i < D / 8; i++) {
                o[i][0] *= al0, o[i][1] *= al0;
                o[i][2] *= al1, o[i][3] *= al1;
            }
        }
        tc_bar<KH>(kh); /* K(j) consumed by every warp */
        if (kv0 + KH * BN < my_end)
            load_tile(Ks, kc, kv0 + KH * BN);
        tc_cp_async_commit(); /* possibly empty: keeps the group count uniform */
        tc_cp_async_wait<1>(); /* this thread's V(j) */
        tc_bar<KH>(kh);
        if (active) {
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                /* the S accumulators of n-tiles 2kk, 2kk+1 are the A fragment of P[:, 16kk..16kk+16) */
                const uint32_t a[4] = {m40k_pack_h2(sc[2 * kk][0], sc[2 * kk][1]),
                                       m40k_pack_h2(sc[2 * kk][2], sc[2 * kk][3]),
                                       m40k_pack_h2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                                       m40k_pack_h2(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
                for (int dp = 0; dp < D / 16; dp++) {
                    uint32_t b[4];
                    tc_ldmatrix_x4_trans(b, Vs + (kk * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * LDS + dp * 16 +
                                                8 * (lane >> 4));
                    tc_mma(o[2 * dp], a, b[0], b[1]);
                    tc_mma(o[2 * dp + 1], a, b[2], b[3]);
                }
            }
        }
        tc_bar<KH>(kh); /* V(j) consumed before V(j+1) is loaded over it */
    }
    tc_cp_async_wait<0>();
    if constexpr (KH == 2) {
        /* half 1's state into its K/V buffers (free: its loop is over, and half 0 never
         * reads them), value i of thread htid at xch[i*128 + htid]; half 0 merges it */
        __syncthreads();
        float *xch = reinterpret_cast<float *>(Qs + TC_BM * LDS + 2 * BN * LDS);
        if (kh == 1) {
#pragma unroll
            for (int i = 0; i < D / 8; i++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    xch[(4 * i + e) * 128 + htid] = o[i][e];
            xch[(D / 2) * 128 + htid] = m0;
            xch[(D / 2 + 1) * 128 + htid] = m1;
            xch[(D / 2 + 2) * 128 + htid] = l0;
            xch[(D / 2 + 3) * 128 + htid] = l1;
        }
        __syncthreads();
        if (kh == 1)
            return;
        const float pm0 = xch[(D / 2) * 128 + htid], pm1 = xch[(D / 2 + 1) * 128 + htid];
        const float M0 = fmaxf(m0, pm0), M1 = fmaxf(m1, pm1);
        /* a state that saw no key (m -inf) weighs nothing; both -inf: l stays 0 */
        const float a0 = m0 == -INFINITY ? 0.0f : exp2f(m0 - M0), b0 = pm0 == -INFINITY ? 0.0f : exp2f(pm0 - M0);
        const float a1 = m1 == -INFINITY ? 0.0f : exp2f(m1 - M1), b1 = pm1 == -INFINITY ? 0.0f : exp2f(pm1 - M1);
#pragma unroll
        for (int i = 0; i < D / 8; i++) {
            o[i][0] = o[i][0] * a0 + xch[(4 * i) * 128 + htid] * b0;
            o[i][1] = o[i][1] * a0 + xch[(4 * i + 1) * 128 + htid] * b0;
            o[i][2] = o[i][2] * a1 + xch[(4 * i + 2) * 128 + htid] * b1;
            o[i][3] = o[i][3] * a1 + xch[(4 * i + 3) * 128 + htid] * b1;
        }
        l0 = l0 * a0 + xch[(D / 2 + 2) * 128 + htid] * b0;
        l1 = l1 * a1 + xch[(D / 2 + 3) * 128 + htid] * b1;
        m0 = M0, m1 = M1;
    }

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    if (n_splits > 1) { /* this split's record of each row: O unnormalized, then m (log2 domain) and l */
        float *rec = ws + (((size_t)blockIdx.x * n_kv_heads + kvh) * n_splits + blockIdx.z) * TC_BM * (D + 2);
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int r = wr0 + g + 8 * half;
            if (r >= nrows)
                continue;
            float *dst = rec + (size_t)r * (D + 2);
#pragma unroll
            for (int i = 0; i < D / 8; i++)
                *reinterpret_cast<float2 *>(dst + 8 * i + 2 * tig) = make_float2(o[i][2 * half], o[i][2 * half + 1]);
            if (tig == 0) {
                dst[D] = half ? m1 : m0;
                dst[D + 1] = half ? l1 : l0;
            }
        }
        return;
    }
    const bool ovec = (out_stride & 1) == 0 && (reinterpret_cast<uintptr_t>(out) & (2 * sizeof(OT) - 1)) == 0;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int r = wr0 + g + 8 * half;
        if (r >= nrows)
            continue;
        const int row = row0 + r, tok = q0 + row / G, h = kvh * G + row % G;
        const float l = half ? l1 : l0;
        /* a sink's logit in the kernel's base-2 units (scores times log2(e)) */
        const float inv = sinks ? m40k_sink_norm2(half ? m1 : m0, l, sinks[h] * 1.4426950408889634f)
                          : l > 0.0f ? 1.0f / l
                                     : 0.0f;
        OT *dst = out + (int64_t)tok * out_stride + (int64_t)h * D + 2 * tig;
#pragma unroll
        for (int i = 0; i < D / 8; i++)
            tc_store2(dst + 8 * i, o[i][2 * half] * inv, o[i][2 * half + 1] * inv, ovec);
    }
#endif
}

/* The key splits of attn_prefill_tc_kernel merged: per row, out = sum_s 2^(m_s - M) O_s /
 * sum_s 2^(m_s - M) l_s with M the largest m_s (a split that saw no key has m = -inf and
 * counts nothing; a row that saw none at all gets zeros, as the one-block kernel gives).
 * One warp a row (blockIdx.z: rows 4z..4z+3 of the tile): lane s holds split s's max and
 * weight (n_splits <= 32), the lanes then stride over the row's D outputs. */
#define TC_MERGE_ROWS (TC_THREADS / 32)
template <int D, typename OT>
__global__ __launch_bounds__(TC_THREADS) void attn_prefill_tc_merge_kernel(
    OT *__restrict__ out, int64_t out_stride, const int32_t *__restrict__ q_indptr, int n_seqs, int n_heads,
    int n_kv_heads, int n_splits, const float *__restrict__ ws, const float *__restrict__ sinks)
{
    const int G = n_heads / n_kv_heads, kvh = blockIdx.y, lane = threadIdx.x & 31;
    int tile;
    const int s = tc_find_tile(q_indptr, n_seqs, G, &tile);
    if (s < 0)
        return;
    const int q0 = q_indptr[s], nq = q_indptr[s + 1] - q0;
    const int row0 = tile * TC_BM, nrows = min(TC_BM, nq * G - row0);
    const int r = blockIdx.z * TC_MERGE_ROWS + (threadIdx.x >> 5);
    if (r >= nrows)
        return;
    const size_t split_stride = (size_t)TC_BM * (D + 2);
    const float *x = ws + ((size_t)blockIdx.x * n_kv_heads + kvh) * n_splits * split_stride + (size_t)r * (D + 2);
    const float m = lane < n_splits ? x[lane * split_stride + D] : -INFINITY;
    float M = m;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    const float w = m == -INFINITY ? 0.0f : exp2f(m - M); /* M is finite where some m is */
    float den = lane < n_splits ? w * x[lane * split_stride + D + 1] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        den += __shfl_xor_sync(0xffffffffu, den, o);
    const int row = row0 + r, tok = q0 + row / G, h = kvh * G + row % G;
    const float inv = sinks ? m40k_sink_norm2(M, den, sinks[h] * 1.4426950408889634f) : den > 0.0f ? 1.0f / den : 0.0f;
    OT *dst = out + (int64_t)tok * out_stride + (int64_t)h * D;
#pragma unroll
    for (int d0 = 0; d0 < D; d0 += 32) {
        float num = 0.0f;
        for (int sp = 0; sp < n_splits; sp++)
            num = fmaf(__shfl_sync(0xffffffffu, w, sp), x[sp * split_stride + d0 + lane], num);
        tc_store1(dst + d0 + lane, num * inv);
    }
}

/* Per device and head dim: 0 not checked yet, 1 usable, -1 not. Racing first calls
 * compute the same answer. */
#define TC_MAX_DEVICES 64
static std::atomic<int> tc_state[TC_MAX_DEVICES][3];
static std::atomic<int> tc_kh_force{0}; /* m40k_attn_prefill_tc_tune: 0 the default, 1 or 2 key halves */

extern "C" void m40k_attn_prefill_tc_tune(int key_halves)
{
    tc_kh_force.store(key_halves == 1 || key_halves == 2 ? key_halves : 0, std::memory_order_relaxed);
}

template <int D> static int tc_check(int dev, int slot)
{
    int st = tc_state[dev][slot].load(std::memory_order_relaxed);
    if (st)
        return st > 0;
    int major = 0, optin = 0;
    cudaFuncAttributes fa;
    bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 8 &&
              cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess &&
              (size_t)optin >= tc_cfg<D>::smem &&
              cudaFuncGetAttributes(&fa, attn_prefill_tc_kernel<D, float, 1>) == cudaSuccess &&
              fa.binaryVersion >= 80 && fa.ptxVersion >= 80;
    if (ok && tc_cfg<D>::smem > 48 * 1024)
        ok = cudaFuncSetAttribute(attn_prefill_tc_kernel<D, float, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  (int)tc_cfg<D>::smem) == cudaSuccess &&
             cudaFuncSetAttribute(attn_prefill_tc_kernel<D, uint16_t, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  (int)tc_cfg<D>::smem) == cudaSuccess;
    if constexpr (tc_kh2<D>::OK) /* the key-halves instances */
        if (ok)
            ok = (size_t)optin >= tc_cfg<D>::smem2 &&
                 cudaFuncSetAttribute(attn_prefill_tc_kernel<D, float, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)tc_cfg<D>::smem2) == cudaSuccess &&
                 cudaFuncSetAttribute(attn_prefill_tc_kernel<D, uint16_t, 2>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)tc_cfg<D>::smem2) == cudaSuccess;
    if (!ok)
        (void)cudaGetLastError(); /* a refusal here is an answer, not a pending error */
    tc_state[dev][slot].store(ok ? 1 : -1, std::memory_order_relaxed);
    return ok;
}

extern "C" int m40k_attn_prefill_tc_supported(int head_dim)
{
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= TC_MAX_DEVICES) {
        (void)cudaGetLastError();
        return 0;
    }
    switch (head_dim) {
    case 64: return tc_check<64>(dev, 0);
    case 128: return tc_check<128>(dev, 1);
    case 256: return tc_check<256>(dev, 2);
    default: return 0;
    }
}

/* Blocks of the grid's x dimension: an upper bound on the row tiles of all sequences
 * (blocks past the last tile return at once). */
static long tc_tiles(int n_rows, int n_seqs, int G) { return ((long)n_rows * G + TC_BM - 1) / TC_BM + n_seqs; }

template <int D, typename OT>
static int tc_launch(OT *out, int64_t os, const float *q, int64_t qs, const int32_t *q_indptr, int n_seqs,
                     int n_rows, const uint16_t *kc, const uint16_t *vc, const int32_t *indptr, const int32_t *indices,
                     const int32_t *lpl, int n_heads, int n_kv_heads, float scale, int window, float softcap,
                     int n_splits, float *ws, const float *sinks, cudaStream_t st)
{
    const int G = n_heads / n_kv_heads;
    const long tiles = tc_tiles(n_rows, n_seqs, G);
    if (tiles > 0x7fffffffL || n_kv_heads > 65535)
        return M40K_INVALID;
    const float scale_log2 = scale * 1.4426950408889634f, softcap_log2 = softcap * 1.4426950408889634f;
    /* two key halves wherever the head dim allows: faster at every shape measured, 13-25%
     * (BENCHMARKS.md, twenty-fourth session) */
    const bool kh2 = tc_kh2<D>::OK && tc_kh_force.load(std::memory_order_relaxed) != 1;
    const dim3 grid((unsigned)tiles, (unsigned)n_kv_heads, (unsigned)n_splits);
    bool launched = false;
    if constexpr (tc_kh2<D>::OK)
        if (kh2) {
            attn_prefill_tc_kernel<D, OT, 2><<<grid, 2 * TC_THREADS, tc_cfg<D>::smem2, st>>>(
                out, os, q, qs, q_indptr, n_seqs, kc, vc, indptr, indices, lpl, n_heads, n_kv_heads, scale_log2, window,
                softcap_log2, n_splits, ws, n_splits > 1 ? nullptr : sinks);
            launched = true;
        }
    if (!launched)
        attn_prefill_tc_kernel<D, OT, 1><<<grid, TC_THREADS, tc_cfg<D>::smem, st>>>(
            out, os, q, qs, q_indptr, n_seqs, kc, vc, indptr, indices, lpl, n_heads, n_kv_heads, scale_log2, window,
            softcap_log2, n_splits, ws, n_splits > 1 ? nullptr : sinks);
    if (n_splits > 1)
        attn_prefill_tc_merge_kernel<D, OT><<<dim3((unsigned)tiles, (unsigned)n_kv_heads, TC_BM / TC_MERGE_ROWS),
                                          TC_THREADS, 0, st>>>(
            out, os, q_indptr, n_seqs, n_heads, n_kv_heads, n_splits, ws, sinks);
    return m40k_launch_status();
}

extern "C" size_t m40k_attn_prefill_split_ws_floats(int n_rows, int n_seqs, int n_heads, int n_kv_heads, int head_dim,
                                                   int n_splits)
{
    if (n_splits <= 1 || n_rows <= 0 || n_seqs <= 0 || n_kv_heads <= 0 || n_heads < n_kv_heads)
        return 0;
    return (size_t)tc_tiles(n_rows, n_seqs, n_heads / n_kv_heads) * (size_t)n_kv_heads * (size_t)n_splits * TC_BM *
           (size_t)(head_dim + 2);
}

extern "C" int m40k_attn_prefill_pick_splits(int n_rows, int n_seqs, int n_heads, int n_kv_heads, int head_dim,
                                             int max_len, int sm_count, size_t ws_floats)
{
    if (n_rows <= 0 || n_seqs <= 0 || n_kv_heads <= 0 || n_heads < n_kv_heads || sm_count <= 0)
        return 1;
    const long blocks = (((long)n_rows * (n_heads / n_kv_heads) + TC_BM - 1) / TC_BM) * n_kv_heads;
    /* a full wave already: splitting only adds the merge (measured: 512 rows after 3,584
     * keys, 256 blocks, 271 us whole, 388 us in two splits); else enough blocks for two
     * waves, each split at least M40K_PREFILL_SPLIT_MIN keys */
    if (blocks >= sm_count)
        return 1;
    long S = (2L * sm_count + blocks - 1) / blocks;
    if (S > max_len / M40K_PREFILL_SPLIT_MIN)
        S = max_len / M40K_PREFILL_SPLIT_MIN;
    if (S > M40K_PREFILL_SPLIT_MAX)
        S = M40K_PREFILL_SPLIT_MAX;
    while (S > 1 && m40k_attn_prefill_split_ws_floats(n_rows, n_seqs, n_heads, n_kv_heads, head_dim, (int)S) > ws_floats)
        S--;
    return S < 1 ? 1 : (int)S;
}

extern "C" int m40k_attn_prefill_tc_split(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                          const int32_t *q_indptr, int n_seqs, int n_rows, const uint16_t *k_cache,
                                          const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                                          const int32_t *last_page_len, int n_heads, int n_kv_heads, int head_dim,
                                          float scale, int window, float softcap, int n_splits, float *ws,
                                          m40k_stream stream)
{
    return m40k_attn_prefill_tc_split_sinks(out, out_stride, q, q_stride, q_indptr, n_seqs, n_rows, k_cache, v_cache,
                                            indptr, indices, last_page_len, n_heads, n_kv_heads, head_dim, scale,
                                            window, softcap, n_splits, ws, nullptr, stream);
}

template <typename OT>
static int tc_split_sinks(OT *out, int64_t out_stride, const float *q, int64_t q_stride,
                                                const int32_t *q_indptr, int n_seqs, int n_rows,
                                                const uint16_t *k_cache, const uint16_t *v_cache,
                                                const int32_t *indptr, const int32_t *indices,
                                                const int32_t *last_page_len, int n_heads, int n_kv_heads,
                                                int head_dim, float scale, int window, float softcap, int n_splits,
                                                float *ws, const float *sinks, m40k_stream stream)
{
    if (n_seqs <= 0 || n_rows <= 0)
        return 0;
    if (n_kv_heads <= 0 || n_heads % n_kv_heads || n_heads / n_kv_heads > 8 || window < 0 || !(softcap >= 0.0f))
        return M40K_INVALID;
    if (head_dim != 64 && head_dim != 128 && head_dim != 256)
        return M40K_INVALID;
    if (n_splits < 1 || n_splits > M40K_PREFILL_SPLIT_MAX || (n_splits > 1 && !ws))
        return M40K_INVALID;
    if (!m40k_attn_prefill_tc_supported(head_dim))
        return (int)cudaErrorNoKernelImageForDevice;
    switch (head_dim) {
    case 64: return tc_launch<64, OT>(out, out_stride, q, q_stride, q_indptr, n_seqs, n_rows, k_cache, v_cache, indptr, indices, last_page_len, n_heads, n_kv_heads, scale, window, softcap, n_splits, ws, sinks, stream);
    case 128: return tc_launch<128, OT>(out, out_stride, q, q_stride, q_indptr, n_seqs, n_rows, k_cache, v_cache, indptr, indices, last_page_len, n_heads, n_kv_heads, scale, window, softcap, n_splits, ws, sinks, stream);
    default: return tc_launch<256, OT>(out, out_stride, q, q_stride, q_indptr, n_seqs, n_rows, k_cache, v_cache, indptr, indices, last_page_len, n_heads, n_kv_heads, scale, window, softcap, n_splits, ws, sinks, stream);
    }
}

extern "C" int m40k_attn_prefill_tc_split_sinks(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                                const int32_t *q_indptr, int n_seqs, int n_rows,
                                                const uint16_t *k_cache, const uint16_t *v_cache,
                                                const int32_t *indptr, const int32_t *indices,
                                                const int32_t *last_page_len, int n_heads, int n_kv_heads,
                                                int head_dim, float scale, int window, float softcap, int n_splits,
                                                float *ws, const float *sinks, m40k_stream stream)
{
    return tc_split_sinks(out, out_stride, q, q_stride, q_indptr, n_seqs, n_rows, k_cache, v_cache, indptr, indices,
                          last_page_len, n_heads, n_kv_heads, head_dim, scale, window, softcap, n_splits, ws, sinks,
                          stream);
}

extern "C" int m40k_attn_prefill_tc_split_sinks_h16(uint16_t *out, int64_t out_stride, const float *q,
                                                    int64_t q_stride, const int32_t *q_indptr, int n_seqs, int n_rows,
                                                    const uint16_t *k_cache, const uint16_t *v_cache,
                                                    const int32_t *indptr, const int32_t *indices,
                                                    const int32_t *last_page_len, int n_heads, int n_kv_heads,
                                                    int head_dim, float scale, int window, float softcap,
                                                    int n_splits, float *ws, const float *sinks, m40k_stream stream)
{
    return tc_split_sinks(out, out_stride, q, q_stride, q_indptr, n_seqs, n_rows, k_cache, v_cache, indptr, indices,
                          last_page_len, n_heads, n_kv_heads, head_dim, scale, window, softcap, n_splits, ws, sinks,
                          stream);
}

extern "C" int m40k_attn_prefill_tc_window(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                           const int32_t *q_indptr, int n_seqs, int n_rows, const uint16_t *k_cache,
                                           const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                                           const int32_t *last_page_len, int n_heads, int n_kv_heads, int head_dim,
                                           float scale, int window, float softcap, m40k_stream stream)
{
    return m40k_attn_prefill_tc_split(out, out_stride, q, q_stride, q_indptr, n_seqs, n_rows, k_cache, v_cache, indptr,
                                      indices, last_page_len, n_heads, n_kv_heads, head_dim, scale, window, softcap, 1,
                                      NULL, stream);
}

extern "C" int m40k_attn_prefill_tc(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                    const int32_t *q_indptr, int n_seqs, int n_rows, const uint16_t *k_cache,
                                    const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                                    const int32_t *last_page_len, int n_heads, int n_kv_heads, int head_dim,
                                    float scale, m40k_stream stream)
{
    return m40k_attn_prefill_tc_window(out, out_stride, q, q_stride, q_indptr, n_seqs, n_rows, k_cache, v_cache,
                                       indptr, indices, last_page_len, n_heads, n_kv_heads, head_dim, scale, 0, 0.0f, stream);
}

extern "C" int m40k_attn_prefill_auto_split(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                            const int32_t *q_indptr, int n_seqs, int n_rows, const uint16_t *k_cache,
                                            const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                                            const int32_t *last_page_len, int n_heads, int n_kv_heads, int head_dim,
                                            float scale, int window, float softcap, int n_splits, float *ws,
                                            m40k_stream stream)
{
    return m40k_attn_prefill_auto_split_sinks(out, out_stride, q, q_stride, q_indptr, n_seqs, n_rows, k_cache, v_cache,
                                              indptr, indices, last_page_len, n_heads, n_kv_heads, head_dim, scale,
                                              window, softcap, n_splits, ws, nullptr, stream);
}

extern "C" int m40k_attn_prefill_auto_split_sinks(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                                  const int32_t *q_indptr, int n_seqs, int n_rows,
                                                  const uint16_t *k_cache, const uint16_t *v_cache,
                                                  const int32_t *indptr, const int32_t *indices,
                                                  const int32_t *last_page_len, int n_heads, int n_kv_heads,
                                                  int head_dim, float scale, int window, float softcap, int n_splits,
                                                  float *ws, const float *sinks, m40k_stream stream)
{
    if (m40k_attn_prefill_tc_supported(head_dim))
        return m40k_attn_prefill_tc_split_sinks(out, out_stride, q, q_stride, q_indptr, n_seqs, n_rows, k_cache,
                                                v_cache, indptr, indices, last_page_len, n_heads, n_kv_heads, head_dim,
                                                scale, window, softcap, n_splits, ws, sinks, stream);
    return m40k_attn_prefill_sinks(out, out_stride, q, q_stride, q_indptr, n_seqs, n_rows, k_cache, v_cache, indptr,
                                   indices, last_page_len, n_heads, n_kv_heads, head_dim, scale, window, softcap,
                                   sinks, stream);
}

extern "C" int m40k_attn_prefill_auto_window(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                             const int32_t *q_indptr, int n_seqs, int n_rows,
                                             const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *indptr,
                                             const int32_t *indices, const int32_t *last_page_len, int n_heads,
                                             int n_kv_heads, int head_dim, float scale, int window, float softcap,
                                             m40k_stream stream)
{
    return m40k_attn_prefill_auto_split(out, out_stride, q, q_stride, q_indptr, n_seqs, n_rows, k_cache, v_cache,
                                        indptr, indices, last_page_len, n_heads, n_kv_heads, head_dim, scale, window,
                                        softcap, 1, NULL, stream);
}

extern "C" int m40k_attn_prefill_auto(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                      const int32_t *q_indptr, int n_seqs, int n_rows, const uint16_t *k_cache,
                                      const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                                      const int32_t *last_page_len, int n_heads, int n_kv_heads, int head_dim,
                                      float scale, m40k_stream stream)
{
    return m40k_attn_prefill_auto_window(out, out_stride, q, q_stride, q_indptr, n_seqs, n_rows, k_cache, v_cache,
                                         indptr, indices, last_page_len, n_heads, n_kv_heads, head_dim, scale, 0,
                                         0.0f, stream);
}
