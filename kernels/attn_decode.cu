/* Paged decode attention (one query token per sequence), grouped-query.
 *
 * Grid (n_kv_heads, n_seqs, n_splits); 128 threads. A block owns one KV head of one
 * sequence (or one range of its pages) and ALL the query heads of that head's group,
 * so each K/V row is read from memory once and used G times.
 *
 * Threads form teams of D/8: a team holds one token's row, each thread 8 dims loaded
 * as one 16-byte vector (consecutive teams read consecutive rows: coalesced). A tile of
 * 4 tokens per team is loaded (K and V together, all loads in flight before use),
 * scores are team-reduced by shuffles, a warp per query head does the online-softmax
 * update of the tile, and every thread accumulates p * V for its 8 dims and G heads in
 * registers. At the end each team stores its partial outputs to shared memory and they
 * are summed in a fixed order (no shared-memory float atomics: those are compare-and-swap
 * loops, and 8 teams adding to the same words made them most of a short split's time).
 * With n_splits > 1 each split writes (unnormalized output, max, sum) to a workspace
 * and the splits are merged in the same launch, by whichever split block of a (sequence,
 * KV head) finishes last (no second kernel: its launch cost ~5 us a layer at batch 1).
 * Each split block stores its partials and counts itself in a per-(sequence, KV head)
 * counter (m40k_split_last: a barrier, then one acq_rel atomic that releases the block's
 * stores); the block that reads n_splits - 1 knows every other split has stored its rows.
 * It reads all the rows back through L2 (__ldcg: this SM's L1 is not coherent with the
 * others' stores), merges them for its G query heads (max over splits, den = sum
 * exp(m_i - M) l_i, num likewise per dim; an empty split leaves max -inf: skipped),
 * writes `out` and sets the counter back to 0. The counters (caller-owned, zeroed once)
 * are therefore zero between calls (two calls in flight at once must not share them).
 * No block ever waits on another, so any block schedule is safe; a PDL-launched GEMV that
 * follows waits (griddepcontrol.wait) for the whole grid, merging blocks included, before
 * it reads `out`. The splits divide the positions evenly (any token boundary). window > 0
 * (sliding-window layers, Gemma 3): only the last `window` positions are read, and the
 * splits divide that range.
 * softcap > 0 (Gemma 2): the warp that runs a head's online-softmax update caps the
 * tile's scores (c * tanh(s / c)) as it reads them, masked ones (-inf) left as they are:
 * a uniform branch outside the unrolled score loop, nothing more held in registers.
 *
 * Few (sequence, KV head) pairs (batch 1-2) on sm_90: the splits of a pair run as one
 * thread block cluster instead (CL below: up to 16 blocks, 64-position tiles, the step's
 * own token in the last split's last tile) and merge through distributed shared memory:
 * no workspace, fence, counter or reload through L2. H100, Mistral-7B shape, 640
 * positions, batch-1 decode: F16 174.6 -> 178.6, Q8_0 281.1 -> 290.1, Q4_K_M 355.4 ->
 * 374.0 tok/s (BENCHMARKS.md, eighth session). Where each block's slice of the merge is
 * whole 32-element blocks (m40k_attn_decode_q8_ok), the merge also writes the int8
 * records of the output for the GEMV after it, a warp a record, with m40k_quantize_q8's
 * function: Q4_K_M 444 -> 448, Q8_0 333 -> 337 tok/s (twelfth session). */
#include "cuda_common.h"
#include "q8_dev.h"
#include "rope_dev.h"

#include <cooperative_groups.h>
#include <math.h>
namespace cg = cooperative_groups;

#define DEC_THREADS 128
#define DEC_TT 4 /* tokens per team per tile */
#define DEC_TT_CL 8 /* in a cluster split (few blocks a launch: 2 an SM are enough) */
/* blocks per SM the registers must allow for groups of up to 4 heads (128 a thread;
 * 8 heads: 2): the RoPE variant (6c) took 135 with no bound, 3 blocks an SM, and ran
 * 1.5x the plain kernel on grids of 4 blocks an SM (H100, 64 sequences x 4,096
 * positions: 598 against 394 us) */
#define DEC_MIN_BLOCKS 4
#define DEC_PF_TILES 4 /* tiles a cluster split prefetches into L1 before its wait */

/* VW consecutive floats (VW 1, 2 or 4; p aligned to VW floats) read through L2 only
 * (ld.global.cg): rows other SMs stored are never served from this SM's L1. */
template <int VW> __device__ __forceinline__ void dec_ldcg(const float *p, float (&w)[VW])
{
    if constexpr (VW == 4) {
        const float4 t = __ldcg(reinterpret_cast<const float4 *>(p));
        w[0] = t.x, w[1] = t.y, w[2] = t.z, w[3] = t.w;
    } else if constexpr (VW == 2) {
        const float2 t = __ldcg(reinterpret_cast<const float2 *>(p));
        w[0] = t.x, w[1] = t.y;
    } else {
        w[0] = __ldcg(p);
    }
}

/* The step's own K/V rows for the fused variant (m40k_attn_decode_rope): row s of k / v
 * is sequence s's new token, k not yet rotated; RoPE as m40k_kv_append_rope's. */
struct dec_rope {
    const float *k, *v;
    int64_t k_stride, v_stride;
    const int32_t *pos;
    const float *ff;
    double log2_base;
    int rot_dim, neox;
    gq_blk *xq; /* or NULL: the cluster merge also writes out as int8 records (kernels.h 6c) */
    int xq_row; /* records a sequence row of xq */
    const float *sinks; /* [n_heads] logits joining each head's softmax (gpt-oss), or NULL */
    /* blocks a KV head's query heads are split over in the cluster variant (dec_plan): 1,
     * or the group size (a block a query head); 0 counts as 1 */
    int hsplit;
    /* per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3: kernels.h 6e), weights of
     * head_dim each, or NULL: none */
    const float *q_norm, *k_norm;
    float norm_eps;
    /* the q/k/v product's biases, added first (gpt-oss, Qwen2: kernels.h 6e): [n_heads *
     * head_dim], [n_kv_heads * head_dim] twice, or all NULL */
    const float *bq, *bk, *bv;
    /* or NULL: out also as F16 (m40k_f2h of each F32 value, rows out_stride apart) for an
     * output projection that reads F16 x (kernels.h 6e) */
    uint16_t *out16;
    /* the host's launch choice only (m40k_dec_opts.plain): the workspace merge of n_splits
     * blocks, never a cluster, whatever the batch */
    int plain;
};

/* RoPE of element d (< rot_dim) whose own value is xd and whose pair's other value is xo
 * (the pair (a, b) as rope_kernel pairs them), rotated with cs[i] = (cos, sin) of the
 * pair, and the half of the result that is d's; the same operations kv_append_rope_kernel
 * applies to K and to Q, so the same bits. */
__device__ __forceinline__ float dec_rope_pair(float xd, float xo, int d, int rot_dim, int neox, const float2 *cs)
{
    const int half = rot_dim / 2;
    const bool first = neox ? d < half : (d & 1) == 0;
    const int i = neox ? (first ? d : d - half) : d >> 1;
    float y0, y1;
    m40k_rope_rotate(first ? xd : xo, first ? xo : xd, cs[i].x, cs[i].y, &y0, &y1);
    return first ? y0 : y1;
}
/* The splits of one (sequence, KV head) as a thread block cluster (sm_90), CL: grid
 * (n_splits, n_kv_heads, n_seqs) in clusters of n_splits blocks along x. Each block keeps
 * its split's unnormalized output, max and sum in its own shared memory; after one
 * cluster barrier, block r merges the r-th slice of the G*D outputs from every block's
 * shared memory (distributed shared memory, rank order: the same sums every run) and
 * writes them. No workspace, fence, counter or L2 round trip: at batch 1 that chain
 * (store, fence, atomic, reload of every split) was most of the kernel's time. */
#define DEC_CL_MAX 16 /* non-portable cluster size (H100: up to 16) */
/* at most this many (sequence, KV head) pairs: with more, the grid fills the GPU anyway
 * and clusters were slower (H100, 16 sequences x 8 KV heads, 576 positions, 4 splits:
 * 22.2 -> 28.0 us) */
#define DEC_CL_GROUPS 16
/* at most this many splits asked for (the engine's pick: one per 32 positions of the
 * longest sequence, rounded up to a power of two): 32 run as 16 blocks of up to 64
 * positions, one tile each; longer ranges keep the workspace merge and its up to 64 blocks */
#define DEC_CL_SPLITS 32

template <int D, int GMAX, bool ROPE, bool CL>
__global__ __launch_bounds__(DEC_THREADS, !CL && GMAX <= 4 ? DEC_MIN_BLOCKS : 2) void attn_decode_kernel(
    float *__restrict__ out, int64_t out_stride, const float *__restrict__ q, int64_t q_stride, uint16_t *kc,
    uint16_t *vc, const int32_t *__restrict__ indptr, const int32_t *__restrict__ indices,
    const int32_t *__restrict__ last_page_len, int n_heads, int n_kv_heads, float scale, int n_splits,
    float *__restrict__ ws, int *__restrict__ counters, int window, float softcap, dec_rope rp)
{
    __shared__ float2 cs[ROPE ? D / 2 : 1]; /* (cos, sin) of the new token's rotation pairs */
    constexpr int TT = CL ? DEC_TT_CL : DEC_TT, TPR = D / 8, NT = DEC_THREADS / TPR, TILE = NT * TT;
    /* hsp > 1 (the RoPE cluster variant only): grid y counts (KV head, part) pairs, each
     * block taking G / hsp of the KV head's query heads */
    const int hsp = ROPE && CL && rp.hsplit > 1 ? rp.hsplit : 1;
    const int gy = CL ? blockIdx.y : blockIdx.x, kvh = gy / hsp, hs = gy % hsp, s = CL ? blockIdx.z : blockIdx.y,
              split = CL ? blockIdx.x : blockIdx.z;
    const int tid = threadIdx.x, tm = tid / TPR, c = tid % TPR;
    m40k_grid_launch_dependents(); /* a PDL-launched kernel may follow */

    /* The block tables (indptr, indices, last_page_len) are uploaded before the step's
     * first kernel and no kernel writes them: read before the wait. */
    const int page0 = indptr[s], npages = indptr[s + 1] - page0;
    const int len = npages > 0 ? (npages - 1) * M40K_PAGE + last_page_len[s] : 0;
    /* sliding window: only the last `window` positions */
    const int start = window > 0 ? max(0, len - window) : 0;
    const int per = (len - start + n_splits - 1) / n_splits;
    const int tok0 = min(len, start + split * per), tok1 = min(len, start + (split + 1) * per);
    const bool has_new = ROPE && tok0 < tok1 && tok1 == len;
    /* positions read from the cache: all of the range, but for the new token */
    const int tc = has_new ? len - 1 : tok1;

    /* Where this thread's row of K (V) for position t sits in the cache (t < len). */
    auto row_at = [&](int t) {
        const int64_t blk = indices[page0 + t / M40K_PAGE];
        return (((size_t)blk * n_kv_heads + kvh) * M40K_PAGE + t % M40K_PAGE) * D + 8 * c;
    };
    if constexpr (ROPE) {
        /* Before the wait, as well: the angles need only pos and the frequency factors,
         * which no kernel of the step writes (the forward pass uploads pos before its
         * first kernel); and the first tile of cached positions, which earlier steps
         * wrote (this kernel appends the step's own token itself, and the other rows'
         * append comes after it), is fetched into L1 (prefetch: no register held across
         * the wait), so at one tile a split the K/V reads overlap the previous kernel's
         * tail and the block waits only for q. */
        if ((int)threadIdx.x < rp.rot_dim / 2) {
            float sn, cv;
            m40k_rope_sincos(rp.pos[s], threadIdx.x, rp.rot_dim, rp.log2_base, rp.ff, &sn, &cv);
            cs[threadIdx.x] = make_float2(cv, sn);
        }
        /* (a cluster split is longer: its first DEC_PF_TILES tiles) */
        for (int t0 = tok0; t0 < tc && t0 < tok0 + (CL ? DEC_PF_TILES : 1) * TILE; t0 += TILE) {
#pragma unroll
            for (int u = 0; u < TT; u++) {
                const int t = t0 + tm + NT * u;
                if (t < tc) {
                    const size_t at = row_at(t);
                    asm volatile("prefetch.global.L1 [%0];" ::"l"(kc + at));
                    asm volatile("prefetch.global.L1 [%0];" ::"l"(vc + at));
                }
            }
        }
        m40k_grid_wait();
        M40K_LAUNDER(rp.k);
        M40K_LAUNDER(rp.v);
    } else {
        m40k_grid_wait(); /* PDL-launched: the previous kernel appended the cache */
    }
    M40K_LAUNDER(out);
    M40K_LAUNDER(q);
    M40K_LAUNDER(kc);
    M40K_LAUNDER(vc);
    M40K_LAUNDER(ws);
    M40K_LAUNDER(counters);
    __shared__ float S[GMAX][TILE];
    __shared__ __align__(16) float P[NT][GMAX * D]; /* the teams' partial outputs */
    __shared__ float m_s[GMAX], l_s[GMAX], alpha_s[GMAX];
    /* G: the query heads this block takes, from head hq0 on */
    const int G = n_heads / n_kv_heads / hsp, hq0 = gy * G;

    /* With RoPE, the group's q (plus its bias where rp.bq, normalized where rp.q_norm,
     * rotated and scaled) and the step's own K and V rows are formed once, 8 elements a
     * thread, spread over the block: q into qsm, K and V (both plus their biases, K
     * normalized and rotated, both rounded to F16 as the cache holds them) into the cache
     * and nks / nvs, by the last split only. Then every team reads its
     * dims of q from qsm. (Each thread rotating its own 8 dims of every head repeated that
     * work in every team, and its unrolled code for all the heads was most of the kernel's
     * instructions.) A row's TPR units are TPR adjacent lanes of a warp (TPR divides 32,
     * nq is a multiple of it, the rounds start at multiples of 32), so a head's sum of
     * squares for its norm is a shuffle among them: no launch of m40k_rmsnorm_qk before
     * this kernel. Under neox a unit's pair values (p8) come in one round where the 8 lie
     * in one half of the rotation (rot_dim % 16 == 0), else one by one. */
    __shared__ __align__(16) float qsm[ROPE ? GMAX * D : 4];
    __shared__ uint4 nks[ROPE ? TPR : 1], nvs[ROPE ? TPR : 1];
    if constexpr (ROPE) {
        __syncthreads(); /* cs */
        const int nq = G * TPR; /* q units of 8 elements; then TPR of K and TPR of V */
        const int n_units = nq + (has_new ? 2 * TPR : 0), rot = rp.rot_dim, half = rot / 2;
        for (int ub = 0; ub < n_units; ub += DEC_THREADS) { /* the same rounds for every thread */
            const int u = ub + tid;
            const bool live = u < n_units, isq = u < nq, isk = !isq && u < nq + TPR, qk = live && (isq || isk);
            const int cu = isq ? u % TPR : (u - nq) % TPR, d0 = 8 * cu;
            const float *row = isq ? q + s * q_stride + (int64_t)(hq0 + u / TPR) * D
                               : isk ? rp.k + s * rp.k_stride + (int64_t)kvh * D
                                     : rp.v + s * rp.v_stride + (int64_t)kvh * D;
            float x8[8] = {}, p8[8] = {}, o[8];
            if (live) {
                const float4 a = *reinterpret_cast<const float4 *>(row + d0),
                             b = *reinterpret_cast<const float4 *>(row + d0 + 4);
                x8[0] = a.x, x8[1] = a.y, x8[2] = a.z, x8[3] = a.w, x8[4] = b.x, x8[5] = b.y, x8[6] = b.z, x8[7] = b.w;
            }
            /* where element d's neox pair sits */
            auto pair_at = [&](int d) { return d < half ? d + half : d - half; };
            const bool pairs = qk && rp.neox && d0 < rot;
            if (pairs) {
                if (rot % 16 == 0) {
                    const int pd = pair_at(d0);
                    const float4 e = *reinterpret_cast<const float4 *>(row + pd),
                                 f = *reinterpret_cast<const float4 *>(row + pd + 4);
                    p8[0] = e.x, p8[1] = e.y, p8[2] = e.z, p8[3] = e.w, p8[4] = f.x, p8[5] = f.y, p8[6] = f.z,
                    p8[7] = f.w;
                } else {
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        if (d0 + i < rot)
                            p8[i] = row[pair_at(d0 + i)];
                }
            }
            if (rp.bq && live) { /* the biases, as m40k_add_bias adds them: the same bits */
                const float *b = isq ? rp.bq + (int64_t)(hq0 + u / TPR) * D : (isk ? rp.bk : rp.bv) + (int64_t)kvh * D;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    x8[i] += b[d0 + i];
                    if (pairs && d0 + i < rot)
                        p8[i] += b[pair_at(d0 + i)];
                }
            }
            if (rp.q_norm) { /* uniform: every lane takes part in the shuffles */
                float ss = 0.0f;
                if (qk)
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        ss = fmaf(x8[i], x8[i], ss);
#pragma unroll
                for (int m = TPR / 2; m > 0; m >>= 1)
                    ss += __shfl_xor_sync(0xffffffffu, ss, m);
                if (qk) {
                    const float r = rsqrtf(ss / (float)D + rp.norm_eps);
                    const float *w = isq ? rp.q_norm : rp.k_norm;
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        x8[i] = x8[i] * r * w[d0 + i];
                        if (pairs && d0 + i < rot)
                            p8[i] = p8[i] * r * w[pair_at(d0 + i)];
                    }
                }
            }
            if (!live)
                continue;
            /* RoPE as kv_append_rope_kernel's: the same operations, the same bits (without
             * neox, d0 is a multiple of 8, so i ^ 1 is d's pair) */
#pragma unroll
            for (int i = 0; i < 8; i++)
                o[i] = qk && d0 + i < rot ? dec_rope_pair(x8[i], rp.neox ? p8[i] : x8[i ^ 1], d0 + i, rot, rp.neox, cs)
                                          : x8[i];
            if (isq) {
                float4 *qd = reinterpret_cast<float4 *>(qsm + (u / TPR) * D + d0);
                qd[0] = make_float4(o[0] * scale, o[1] * scale, o[2] * scale, o[3] * scale);
                qd[1] = make_float4(o[4] * scale, o[5] * scale, o[6] * scale, o[7] * scale);
            } else {
                const uint4 h = m40k_pack_h8(o);
                const int t = len - 1;
                const size_t at =
                    (((size_t)indices[page0 + t / M40K_PAGE] * n_kv_heads + kvh) * M40K_PAGE + t % M40K_PAGE) * D + d0;
                if (hs == 0) /* the KV head's other parts form the same row for their own use only */
                    *reinterpret_cast<uint4 *>((isk ? kc : vc) + at) = h;
                (isk ? nks : nvs)[cu] = h;
            }
        }
    }
    float qr[GMAX][8], acc[GMAX][8];
    if (tid < GMAX)
        m_s[tid] = -INFINITY, l_s[tid] = 0.0f;
    if (ROPE)
        __syncthreads(); /* qsm, nks, nvs */
#pragma unroll
    for (int g = 0; g < GMAX; g++) {
        float qv[8];
        if constexpr (ROPE) {
            const float *qh = qsm + min(g, G - 1) * D + 8 * c;
            const float4 a = *reinterpret_cast<const float4 *>(qh), b = *reinterpret_cast<const float4 *>(qh + 4);
            qv[0] = a.x, qv[1] = a.y, qv[2] = a.z, qv[3] = a.w, qv[4] = b.x, qv[5] = b.y, qv[6] = b.z, qv[7] = b.w;
        } else {
            const float *qh = q + s * q_stride + (int64_t)(hq0 + min(g, G - 1)) * D + 8 * c;
            const float4 a = *reinterpret_cast<const float4 *>(qh), b = *reinterpret_cast<const float4 *>(qh + 4);
            qv[0] = a.x * scale, qv[1] = a.y * scale, qv[2] = a.z * scale, qv[3] = a.w * scale;
            qv[4] = b.x * scale, qv[5] = b.y * scale, qv[6] = b.z * scale, qv[7] = b.w * scale;
        }
#pragma unroll
        for (int i = 0; i < 8; i++)
            qr[g][i] = g < G ? qv[i] : 0.0f, acc[g][i] = 0.0f;
    }
    __syncthreads(); /* m_s, l_s */

    /* One tile: the rows kr / vr of positions t0 + tm + NT*u (those >= tend are not
     * part of it): scores, the online-softmax update, p * V into acc. */
    auto tile = [&](int t0, int tend, const uint4 (&kr)[TT], const uint4 (&vr)[TT]) {
#pragma unroll
        for (int u = 0; u < TT; u++) {
            float kf[8];
            m40k_unpack_h8(kr[u], kf);
            const bool valid = t0 + tm + NT * u < tend;
#pragma unroll
            for (int g = 0; g < GMAX; g++) {
                float d = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; i++)
                    d = fmaf(qr[g][i], kf[i], d);
#pragma unroll
                for (int o = TPR / 2; o > 0; o >>= 1)
                    d += __shfl_xor_sync(0xffffffffu, d, o);
                if (c == 0)
                    S[g][tm + NT * u] = valid ? d : -INFINITY;
            }
        }
        __syncthreads();
        /* online softmax: warp w updates heads w, w+4, ... */
        for (int g = tid >> 5; g < G; g += DEC_THREADS / 32) {
            const int lane = tid & 31;
            float mx = -INFINITY;
            if (softcap > 0.0f) { /* uniform: the kernel argument */
                for (int j = lane; j < TILE; j += 32) {
                    const float v = S[g][j];
                    const float c = v == -INFINITY ? v : softcap * tanhf(v / softcap);
                    S[g][j] = c;
                    mx = fmaxf(mx, c);
                }
            } else {
                for (int j = lane; j < TILE; j += 32)
                    mx = fmaxf(mx, S[g][j]);
            }
            mx = m40k_warp_max(mx);
            const float m_old = m_s[g], m_new = fmaxf(m_old, mx);
            float sum = 0.0f;
            for (int j = lane; j < TILE; j += 32) {
                const float p = __expf(S[g][j] - m_new);
                S[g][j] = p;
                sum += p;
            }
            sum = m40k_warp_sum(sum);
            if (lane == 0) {
                const float a = __expf(m_old - m_new);
                alpha_s[g] = a;
                l_s[g] = l_s[g] * a + sum;
                m_s[g] = m_new;
            }
        }
        __syncthreads();
        float vf[TT][8];
#pragma unroll
        for (int u = 0; u < TT; u++)
            m40k_unpack_h8(vr[u], vf[u]);
#pragma unroll
        for (int g = 0; g < GMAX; g++) {
            if (g < G) {
                const float a = alpha_s[g];
#pragma unroll
                for (int i = 0; i < 8; i++)
                    acc[g][i] *= a;
#pragma unroll
                for (int u = 0; u < TT; u++) {
                    const float p = S[g][tm + NT * u];
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        acc[g][i] = fmaf(p, vf[u][i], acc[g][i]);
                }
            }
        }
        __syncthreads();
    };

    /* A cluster split takes the new token in its last tile, from nks / nvs (so the last
     * split, on the launch's critical path, runs no tile more than the others). */
    constexpr bool FOLD = CL && ROPE;
    const int tl = FOLD ? tok1 : tc; /* positions the loop covers */
    for (int t0 = tok0; t0 < tl; t0 += TILE) {
        uint4 kr[TT], vr[TT];
#pragma unroll
        for (int u = 0; u < TT; u++) {
            const int t = t0 + tm + NT * u;
            if (t < tc) {
                const size_t at = row_at(t);
                kr[u] = __ldg(reinterpret_cast<const uint4 *>(kc + at));
                vr[u] = __ldg(reinterpret_cast<const uint4 *>(vc + at));
            } else if (FOLD && t < tl) { /* t == len - 1: the new token */
                kr[u] = nks[c];
                vr[u] = nvs[c];
            } else {
                kr[u] = make_uint4(0, 0, 0, 0);
                vr[u] = make_uint4(0, 0, 0, 0);
            }
        }
        tile(t0, tl, kr, vr);
    }
    if (!FOLD && has_new) { /* the new token as a tile of its own (team 0's first row) */
        uint4 kr[TT], vr[TT];
#pragma unroll
        for (int u = 0; u < TT; u++)
            kr[u] = u == 0 ? nks[c] : make_uint4(0, 0, 0, 0), vr[u] = u == 0 ? nvs[c] : make_uint4(0, 0, 0, 0);
        tile(len - 1, len, kr, vr);
    }

#pragma unroll
    for (int g = 0; g < GMAX; g++)
        if (g < G) {
            float4 *pp = reinterpret_cast<float4 *>(&P[tm][g * D + 8 * c]);
            pp[0] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
            pp[1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
        }
    __syncthreads();
    for (int j = tid; j < G * D; j += DEC_THREADS) {
        const int g = j / D, d = j % D, h = hq0 + g;
        float o = 0.0f;
#pragma unroll
        for (int t = 0; t < NT; t++)
            o += P[t][j];
        if (n_splits == 1) {
            const float l = l_s[g];
            const float v = rp.sinks ? o * m40k_sink_norm(m_s[g], l, rp.sinks[h]) : l > 0.0f ? o / l : 0.0f;
            out[s * out_stride + (int64_t)h * D + d] = v;
            if (rp.out16)
                rp.out16[s * out_stride + (int64_t)h * D + d] = m40k_f2h(v);
        } else if (CL) {
            P[0][j] = o; /* row 0's word j: read above by this thread only */
        } else {
            const size_t r = ((size_t)s * n_heads + h) * n_splits + split;
            ws[r * D + d] = o;
            if (d == 0) {
                float *ml = ws + (size_t)gridDim.y * n_heads * n_splits * D;
                ml[2 * r] = m_s[g];
                ml[2 * r + 1] = l_s[g];
            }
        }
    }
    if (n_splits == 1)
        return;
    if constexpr (CL) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        cg::cluster_group cluster = cg::this_cluster();
        cluster.sync(); /* every split's P[0], m_s, l_s written */
        const int per = (G * D + n_splits - 1) / n_splits, j0 = split * per, j1 = min(G * D, j0 + per);
        /* output j of the block's G*D: the splits' rows rescaled to their common max */
        auto merged = [&](int j) {
            const int g = j / D;
            float m[DEC_CL_MAX], l[DEC_CL_MAX], o[DEC_CL_MAX];
#pragma unroll
            for (int r = 0; r < DEC_CL_MAX; r++)
                if (r < n_splits) {
                    m[r] = *cluster.map_shared_rank(&m_s[g], r);
                    l[r] = *cluster.map_shared_rank(&l_s[g], r);
                    o[r] = *cluster.map_shared_rank(&P[0][j], r);
                }
            float M = -INFINITY;
#pragma unroll
            for (int r = 0; r < DEC_CL_MAX; r++)
                if (r < n_splits)
                    M = fmaxf(M, m[r]);
            float den = 0.0f, num = 0.0f;
#pragma unroll
            for (int r = 0; r < DEC_CL_MAX; r++)
                if (r < n_splits && m[r] != -INFINITY) { /* an empty split: max -inf, skipped */
                    const float e = __expf(m[r] - M);
                    den += e * l[r];
                    num += e * o[r];
                }
            if (rp.sinks)
                return num * m40k_sink_norm(M, den, rp.sinks[hq0 + g]);
            return den > 0.0f ? num / den : 0.0f;
        };
        float *ob = out + s * out_stride + (int64_t)hq0 * D;
        for (int j = j0 + tid; j < j1; j += DEC_THREADS) {
            const float v = merged(j);
            ob[j] = v;
            if (rp.out16)
                rp.out16[s * out_stride + (int64_t)hq0 * D + j] = m40k_f2h(v);
            /* the next GEMV's int8 records of the slice, a warp a record, as m40k_quantize_q8
             * forms them from out (the same bytes): the slice is whole 32-element blocks
             * (m40k_attn_decode_q8_ok), so the loop keeps warps whole */
            if constexpr (ROPE)
                if (rp.xq)
                    gq_quantize_block(v, tid & 31,
                                      rp.xq + (size_t)s * rp.xq_row + ((size_t)hq0 * D + j - (tid & 31)) / 32);
        }
        cluster.sync(); /* no block leaves while another still reads its shared memory */
#endif
        return;
    }

    /* Count this split in (m40k_split_last); the last of the (sequence, KV head) to arrive
     * merges. An empty split (tok0 == tok1) also gets here: it stored zeros and max -inf,
     * and it must be counted. */
    int *cnt = counters + (size_t)s * n_kv_heads + kvh;
    if (!m40k_split_last(cnt, n_splits))
        return;
    if (tid == 0)
        atomicExch(cnt, 0); /* all n_splits have counted: nothing else touches it in this launch */

    /* Merge: every split rescaled to the common max M of its head, out = num / den with
     * den = sum_i exp(m_i - M) l_i and num = sum_i exp(m_i - M) o_i (splits with m_i
     * -inf skipped). Warp w finds M and den of heads w, w+4, ... with the splits spread
     * over its lanes (one round of loads, not a chain of n_splits); then each thread sums
     * VW consecutive dims of the block's G*D outputs over the splits (VW up to 4, as wide
     * as keeps the 128 threads busy: one 4- to 16-byte load per split and thread). */
    __shared__ float M_s[GMAX], den_s[GMAX];
    constexpr int VW = GMAX * D >= 4 * DEC_THREADS ? 4 : GMAX * D >= 2 * DEC_THREADS ? 2 : 1;
    /* splits per unrolled round of loads: at batch 1 the merge is the tail of the
     * layer's attention and each round an L2 round trip, so 16 (H100, 1 sequence, 576
     * positions, 18 splits: 4 a round took 5 rounds) */
    constexpr int MU = 16;
    const size_t r0 = ((size_t)s * n_heads + (size_t)hq0) * n_splits; /* head hq0, split 0 */
    const float *mlb = ws + (size_t)gridDim.y * n_heads * n_splits * D + 2 * r0;
    for (int g = tid >> 5; g < G; g += DEC_THREADS / 32) {
        const int lane = tid & 31;
        const float *ml = mlb + 2 * (size_t)g * n_splits;
        /* (M, den) over the lane's splits, rescaled as the max grows, then over the warp:
         * one round of loads of (m, l) pairs */
        float M = -INFINITY, den = 0.0f;
        for (int i = lane; i < n_splits; i += 32) {
            const float2 t = __ldcg(reinterpret_cast<const float2 *>(ml + 2 * i));
            if (t.x != -INFINITY) {
                const float Mn = fmaxf(M, t.x);
                den = den * __expf(M - Mn) + t.y * __expf(t.x - Mn);
                M = Mn;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float Mo = __shfl_xor_sync(0xffffffffu, M, o), dn = __shfl_xor_sync(0xffffffffu, den, o);
            const float Mn = fmaxf(M, Mo);
            if (Mn != -INFINITY) {
                den = den * __expf(M - Mn) + dn * __expf(Mo - Mn);
                M = Mn;
            }
        }
        if (lane == 0)
            M_s[g] = M, den_s[g] = den;
    }
    __syncthreads();
    for (int j = tid; j < G * (D / VW); j += DEC_THREADS) {
        const int g = j / (D / VW), d = VW * (j % (D / VW));
        const float M = M_s[g], den = den_s[g];
        const float *ml = mlb + 2 * (size_t)g * n_splits, *row = ws + (r0 + (size_t)g * n_splits) * D + d;
        float num[VW];
#pragma unroll
        for (int k = 0; k < VW; k++)
            num[k] = 0.0f;
#pragma unroll MU
        for (int i = 0; i < n_splits; i++) {
            const float m = __ldcg(ml + 2 * i);
            float w[VW];
            dec_ldcg<VW>(row + (size_t)i * D, w); /* an empty split's row: zeros */
            if (m != -INFINITY) {
                const float e = __expf(m - M);
#pragma unroll
                for (int k = 0; k < VW; k++)
                    num[k] += e * w[k];
            }
        }
        float *op = out + s * out_stride + (int64_t)(hq0 + g) * D + d;
        const float f = rp.sinks ? m40k_sink_norm(M, den, rp.sinks[hq0 + g]) : den > 0.0f ? 1.0f / den : 0.0f;
#pragma unroll
        for (int k = 0; k < VW; k++)
            op[k] = num[k] * f;
        if (rp.out16)
#pragma unroll
            for (int k = 0; k < VW; k++)
                rp.out16[s * out_stride + (int64_t)(hq0 + g) * D + d + k] = m40k_f2h(num[k] * f);
    }
}

extern "C" size_t m40k_decode_workspace_floats(int n_seqs, int n_heads, int head_dim, int n_splits)
{
    return n_splits > 1 ? (size_t)n_seqs * n_heads * n_splits * (head_dim + 2) : 0;
}

extern "C" size_t m40k_decode_counter_ints(int n_seqs, int n_kv_heads)
{
    return n_seqs > 0 && n_kv_heads > 0 ? (size_t)n_seqs * n_kv_heads : 0;
}

/* About one 32-token tile per split (the tile at D=128), as long as the grid stays
 * within 4 blocks per SM and 64 splits: a block walks its range tile by tile, each tile
 * a dependent round of loads, shuffles and barriers at one warp per scheduler, so at
 * small batches time follows the tiles per block, not the bytes (H100, batch 1, 8 KV
 * heads, 515 positions: 2 splits of 256 took 33 us a layer, 8 of 65 21 us). */
extern "C" int m40k_decode_pick_splits(int n_seqs, int n_kv_heads, int max_seq_len, int sm_count)
{
    const int blocks = n_seqs * n_kv_heads;
    int splits = (max_seq_len + 31) / 32;
    const int cap = blocks > 0 ? 4 * sm_count / blocks : 1;
    if (splits > cap)
        splits = cap;
    if (splits > 64)
        splits = 64;
    return splits < 1 ? 1 : splits;
}

/* Cluster size for a launch of n_splits splits: 0 (the workspace merge) unless clusters
 * run here, n_splits is 2..DEC_CL_SPLITS (longer ranges keep more blocks: up to 64
 * splits) and the kernel instance takes clusters here (m40k_cluster_size_fit, asked once
 * per instance and device): min(n_splits, the largest size that fits, up to 16). */
template <int D, int GMAX, bool ROPE> static int dec_cluster_size(int n_splits, int n_seqs, int n_kv_heads)
{
    if (n_splits < 2 || n_splits > DEC_CL_SPLITS || (int64_t)n_seqs * n_kv_heads > DEC_CL_GROUPS ||
        !m40k_clusters_enabled())
        return 0;
    void (*kernel)(float *, int64_t, const float *, int64_t, uint16_t *, uint16_t *, const int32_t *,
                   const int32_t *, const int32_t *, int, int, float, int, float *, int *, int, float, dec_rope) =
        attn_decode_kernel<D, GMAX, ROPE, true>;
    static signed char by_dev[64]; /* per kernel instance: 0 unknown, -1 no, else the largest size */
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64)
        return 0;
    if (by_dev[dev] == 0) {
        const int best = m40k_cluster_size_fit(kernel, DEC_CL_MAX, 2, DEC_THREADS);
        by_dev[dev] = best > 0 ? (signed char)best : -1;
    }
    if (by_dev[dev] < 2)
        return 0;
    return n_splits < by_dev[dev] ? n_splits : by_dev[dev];
}

template <int D, int GMAX>
static int decode_launch(float *out, int64_t os, const float *q, int64_t qs, uint16_t *kc, uint16_t *vc,
                         const int32_t *indptr, const int32_t *indices, const int32_t *lpl, int n_seqs, int n_heads,
                         int n_kv_heads, float scale, int n_splits, float *ws, int *cnt, int window, float cap,
                         const dec_rope *rp, cudaStream_t st)
{
    if (rp) {
        const int C = rp->plain ? 0 : dec_cluster_size<D, GMAX, true>(n_splits, n_seqs, n_kv_heads);
        if (C > 0) {
            const int e = m40k_launch_ex(attn_decode_kernel<D, GMAX, true, true>,
                                         dim3((unsigned)C, (unsigned)n_kv_heads, (unsigned)n_seqs), dim3(DEC_THREADS),
                                         0, (unsigned)C, st, out, os, q, qs, kc, vc, indptr, indices, lpl, n_heads,
                                         n_kv_heads, scale, C, ws, cnt, window, cap, *rp);
            return e ? e : m40k_launch_status();
        }
    } else {
        const int C = dec_cluster_size<D, GMAX, false>(n_splits, n_seqs, n_kv_heads);
        if (C > 0) {
            const int e = m40k_launch_ex(attn_decode_kernel<D, GMAX, false, true>,
                                         dim3((unsigned)C, (unsigned)n_kv_heads, (unsigned)n_seqs), dim3(DEC_THREADS),
                                         0, (unsigned)C, st, out, os, q, qs, kc, vc, indptr, indices, lpl, n_heads,
                                         n_kv_heads, scale, C, ws, cnt, window, cap, dec_rope{});
            return e ? e : m40k_launch_status();
        }
    }
    dim3 grid((unsigned)n_kv_heads, (unsigned)n_seqs, (unsigned)n_splits);
    if (rp)
        M40K_LAUNCH_PDL((attn_decode_kernel<D, GMAX, true, false>), grid, DEC_THREADS, 0, st, out, os, q, qs, kc, vc,
                        indptr, indices, lpl, n_heads, n_kv_heads, scale, n_splits, ws, cnt, window, cap, *rp);
    else
        M40K_LAUNCH_PDL((attn_decode_kernel<D, GMAX, false, false>), grid, DEC_THREADS, 0, st, out, os, q, qs, kc, vc,
                        indptr, indices, lpl, n_heads, n_kv_heads, scale, n_splits, ws, cnt, window, cap, dec_rope{});
    return m40k_launch_status();
}

/* A block a query head (dec_rope.hsplit = G) in the RoPE cluster variant, for the few
 * (sequence, KV head) pairs of small batches: there a block of the whole group's G heads
 * works through them one after the other in each thread (qwen3-30b-a3b at batch 1, G 8:
 * 254 registers, one warp a scheduler, ~3,900 instructions a warp, 18 us under Nsight
 * Compute; BENCHMARKS.md, twenty-seventh session). Where the cluster variant runs at all
 * (dec_cluster_size of the one-head instance), G >= 2, at most DEC_HS_GROUPS (sequence,
 * query head) pairs, and with a cluster size C that leaves each block whole 32-element
 * blocks of the head's D outputs to merge (the int8 records of kernels.h 6c): the split
 * factor G and *C; else 1. Never where the engine's M40_DEC_HSPLIT=0 turned it off. */
#define DEC_HS_GROUPS 64
template <int D> static int dec_head_split(int G, int n_splits, int n_seqs, int n_kv_heads, int *C)
{
    if (!m40k_head_split_enabled() || G < 2 || (int64_t)n_seqs * n_kv_heads * G > DEC_HS_GROUPS)
        return 1;
    int c = dec_cluster_size<D, 1, true>(n_splits, n_seqs, n_kv_heads);
    while (c >= 2 && (D % c || (D / c) % 32))
        c--;
    if (c < 2)
        return 1;
    *C = c;
    return G;
}

static int dec_head_split_any(int head_dim, int G, int n_splits, int n_seqs, int n_kv_heads, int *C)
{
    switch (head_dim) {
    case 64: return dec_head_split<64>(G, n_splits, n_seqs, n_kv_heads, C);
    case 128: return dec_head_split<128>(G, n_splits, n_seqs, n_kv_heads, C);
    case 256: return dec_head_split<256>(G, n_splits, n_seqs, n_kv_heads, C);
    default: return 1;
    }
}

template <int D>
static int decode_group(int G, float *out, int64_t os, const float *q, int64_t qs, uint16_t *kc, uint16_t *vc,
                        const int32_t *indptr, const int32_t *indices, const int32_t *lpl, int n_seqs, int n_heads,
                        int n_kv_heads, float scale, int n_splits, float *ws, int *cnt, int window, float cap,
                        const dec_rope *rp, cudaStream_t st)
{
    if (rp && !rp->plain) {
        int C = 0;
        const int hs = dec_head_split<D>(G, n_splits, n_seqs, n_kv_heads, &C);
        if (hs > 1) { /* grid y: (KV head, query head of its group) */
            dec_rope r = *rp;
            r.hsplit = hs;
            const int e = m40k_launch_ex(attn_decode_kernel<D, 1, true, true>,
                                         dim3((unsigned)C, (unsigned)(n_kv_heads * hs), (unsigned)n_seqs),
                                         dim3(DEC_THREADS), 0, (unsigned)C, st, out, os, q, qs, kc, vc, indptr,
                                         indices, lpl, n_heads, n_kv_heads, scale, C, ws, cnt, window, cap, r);
            return e ? e : m40k_launch_status();
        }
    }
    if (G == 1)
        return decode_launch<D, 1>(out, os, q, qs, kc, vc, indptr, indices, lpl, n_seqs, n_heads, n_kv_heads, scale,
                                   n_splits, ws, cnt, window, cap, rp, st);
    if (G == 2)
        return decode_launch<D, 2>(out, os, q, qs, kc, vc, indptr, indices, lpl, n_seqs, n_heads, n_kv_heads, scale,
                                   n_splits, ws, cnt, window, cap, rp, st);
    if (G <= 4)
        return decode_launch<D, 4>(out, os, q, qs, kc, vc, indptr, indices, lpl, n_seqs, n_heads, n_kv_heads, scale,
                                   n_splits, ws, cnt, window, cap, rp, st);
    return decode_launch<D, 8>(out, os, q, qs, kc, vc, indptr, indices, lpl, n_seqs, n_heads, n_kv_heads, scale,
                               n_splits, ws, cnt, window, cap, rp, st);
}

static int decode_any(float *out, int64_t out_stride, const float *q, int64_t q_stride, uint16_t *k_cache,
                      uint16_t *v_cache, const int32_t *indptr, const int32_t *indices, const int32_t *last_page_len,
                      int n_seqs, int n_heads, int n_kv_heads, int head_dim, float scale, int window, float softcap,
                      int n_splits, float *workspace, int *counters, const dec_rope *rp, m40k_stream stream)
{
    if (n_seqs <= 0)
        return 0;
    if (n_kv_heads <= 0 || n_heads % n_kv_heads || n_heads / n_kv_heads > 8 || n_splits < 1 || n_seqs > 65535 ||
        n_splits > 65535 || (n_splits > 1 && (!workspace || !counters || (uintptr_t)workspace % 16)) ||
        q_stride % 4 || ((uintptr_t)q & 15) || window < 0 || !(softcap >= 0.0f))
        return M40K_INVALID;
    const int G = n_heads / n_kv_heads;
    switch (head_dim) {
    case 64: return decode_group<64>(G, out, out_stride, q, q_stride, k_cache, v_cache, indptr, indices, last_page_len, n_seqs, n_heads, n_kv_heads, scale, n_splits, workspace, counters, window, softcap, rp, stream);
    case 128: return decode_group<128>(G, out, out_stride, q, q_stride, k_cache, v_cache, indptr, indices, last_page_len, n_seqs, n_heads, n_kv_heads, scale, n_splits, workspace, counters, window, softcap, rp, stream);
    case 256: return decode_group<256>(G, out, out_stride, q, q_stride, k_cache, v_cache, indptr, indices, last_page_len, n_seqs, n_heads, n_kv_heads, scale, n_splits, workspace, counters, window, softcap, rp, stream);
    default: return M40K_INVALID;
    }
}

extern "C" int m40k_attn_decode_window(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                       const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *indptr,
                                       const int32_t *indices, const int32_t *last_page_len, int n_seqs, int n_heads,
                                       int n_kv_heads, int head_dim, float scale, int window, float softcap,
                                       int n_splits, float *workspace, int *counters, m40k_stream stream)
{
    /* the kernel writes the caches only in its RoPE variant */
    return decode_any(out, out_stride, q, q_stride, const_cast<uint16_t *>(k_cache), const_cast<uint16_t *>(v_cache),
                      indptr, indices, last_page_len, n_seqs, n_heads, n_kv_heads, head_dim, scale, window, softcap,
                      n_splits, workspace, counters, nullptr, stream);
}

extern "C" int m40k_attn_decode(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *indptr,
                                const int32_t *indices, const int32_t *last_page_len, int n_seqs, int n_heads,
                                int n_kv_heads, int head_dim, float scale, int n_splits, float *workspace,
                                int *counters, m40k_stream stream)
{
    return m40k_attn_decode_window(out, out_stride, q, q_stride, k_cache, v_cache, indptr, indices, last_page_len,
                                   n_seqs, n_heads, n_kv_heads, head_dim, scale, 0, 0.0f, n_splits, workspace,
                                   counters, stream);
}

/* The cluster size the RoPE variant runs a launch with (0: the workspace merge), as
 * decode_launch picks it. */
static int rope_cluster_size(int head_dim, int G, int n_splits, int n_seqs, int n_kv_heads)
{
#define DEC_RCS(D)                                                                                                     \
    return G == 1   ? dec_cluster_size<D, 1, true>(n_splits, n_seqs, n_kv_heads)                                     \
           : G == 2 ? dec_cluster_size<D, 2, true>(n_splits, n_seqs, n_kv_heads)                                     \
           : G <= 4 ? dec_cluster_size<D, 4, true>(n_splits, n_seqs, n_kv_heads)                                     \
                    : dec_cluster_size<D, 8, true>(n_splits, n_seqs, n_kv_heads)
    switch (head_dim) {
    case 64: DEC_RCS(64);
    case 128: DEC_RCS(128);
    case 256: DEC_RCS(256);
    default: return 0;
    }
#undef DEC_RCS
}

extern "C" int m40k_attn_decode_q8_ok(int n_seqs, int n_heads, int n_kv_heads, int head_dim, int n_splits)
{
    if (n_seqs < 1 || n_seqs > 8 || n_kv_heads <= 0 || n_heads % n_kv_heads || n_heads / n_kv_heads > 8)
        return 0;
    const int G = n_heads / n_kv_heads;
    int Ch = 0;
    if (dec_head_split_any(head_dim, G, n_splits, n_seqs, n_kv_heads, &Ch) > 1)
        return 1; /* a block a head, its cluster size picked for whole 32-element slices */
    const int C = rope_cluster_size(head_dim, G, n_splits, n_seqs, n_kv_heads);
    if (C < 2)
        return 0;
    /* a cluster block's slice of the G*D outputs: whole 32-element blocks, one round of its threads */
    return (G * head_dim) % C == 0 && (G * head_dim / C) % 32 == 0 && G * head_dim / C <= DEC_THREADS;
}

extern "C" int m40k_attn_decode_rope(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                     const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                                     uint16_t *k_cache, uint16_t *v_cache, const int32_t *indptr,
                                     const int32_t *indices, const int32_t *last_page_len, int n_seqs, int n_heads,
                                     int n_kv_heads, int head_dim, float scale, int window, float softcap,
                                     const int32_t *pos, int rot_dim, float base, const float *freq_factors, int neox,
                                     int n_splits, float *workspace, int *counters, const m40k_dec_opts *opts,
                                     m40k_stream stream)
{
    const m40k_dec_opts o = opts ? *opts : m40k_dec_opts{};
    if (n_seqs <= 0)
        return 0;
    if (!o.q_norm != !o.k_norm || (o.q_norm && !(o.norm_eps >= 0.0f)) || !o.bias_q != !o.bias_k ||
        !o.bias_q != !o.bias_v)
        return M40K_INVALID;
    void *out_q8 = o.out_q8;
    /* m40k_kv_append_rope's refusals, and the 16-byte rows the kernel reads */
    if (rot_dim < 0 || rot_dim % 2 || rot_dim > head_dim || (rot_dim > 0 && (!(base > 0.0f) || !pos)) || !k || !v ||
        ((uintptr_t)k & 15) || ((uintptr_t)v & 15) || k_stride % 4 || v_stride % 4)
        return M40K_INVALID;
    if (out_q8 &&
        (((uintptr_t)out_q8 & 15) || !m40k_attn_decode_q8_ok(n_seqs, n_heads, n_kv_heads, head_dim, n_splits)))
        return M40K_INVALID;
    const dec_rope rp = {k,
                         v,
                         k_stride,
                         v_stride,
                         pos,
                         freq_factors,
                         rot_dim > 0 ? log2((double)base) : 0.0,
                         rot_dim,
                         neox,
                         (gq_blk *)out_q8,
                         n_heads * head_dim / 32,
                         o.sinks,
                         0,
                         o.q_norm,
                         o.k_norm,
                         o.norm_eps,
                         o.bias_q,
                         o.bias_k,
                         o.bias_v,
                         o.out16,
                         o.plain};
    return decode_any(out, out_stride, q, q_stride, k_cache, v_cache, indptr, indices, last_page_len, n_seqs, n_heads,
                      n_kv_heads, head_dim, scale, window, softcap, n_splits, workspace, counters, &rp, stream);
}
