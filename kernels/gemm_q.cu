/* Quantized GEMM on the tensor cores for products of 9 and more token rows (kernels.h
 * 8e): y[t][r] = sum_k W[r][k] x[t][k], W in any GGUF weight type the GPU reads, x in F16.
 *
 * Why this design (weight tiles dequantized in shared memory, F16 mma.sync) rather than
 * int8 MMA on the weight blocks: one code path serves every type (m40k_group8 of
 * quant_dev.h turns 8 elements of any type into small integers with one scale and one
 * offset, turned into F16 weights two at a time by mq_pack); x is the F16 copy the tiled
 * path's cuBLAS product read before; and the cost that motivated the change (the F16
 * copy of every matrix written and read again on every step) is gone: weights are read
 * once per block of token rows, in their quantized bytes. BENCHMARKS.md has the
 * measurements, and what holds the kernel today (issue rate, not bandwidth).
 *
 * Block: 8 warps, 128 weight rows x BM token rows (BM 16, 32, 64 or 128), K in steps of
 * 64. Per step the block dequantizes its 128 x 64 weight tile into shared memory (each
 * thread four groups of 8 elements) and stores the x tile (BM x 64 F16, loaded two steps
 * ahead into registers), then the warps multiply (see mq_kernel for the staging of the
 * raw weights). Each warp owns a 16*MT x 8*NT piece of the output: ldmatrix A
 * fragments from the weight tile (rows = weight rows), B fragments from the x tile
 * (rows = token rows, k contiguous: the mma's "col" operand as it is), F32 accumulators.
 * Rows of shared memory are padded by 16 bytes: 8 rows of an ldmatrix hit 8 different
 * bank quads.
 *
 * Split-K (few output tiles, as in decode batches of a few dozen rows): split s writes
 * its partial tile to the workspace, fences and counts on its tile's counter; the block
 * that counts last sums the splits in order 0..S-1 (deterministic) into y and resets the
 * counter to zero (kernels.h 8e: the caller zeroes the counters once). */
#include "gemm_q_dev.h"

#define MQ_BN 128             /* weight rows a block */
#define MQ_BK 64              /* K a step */
#define MQ_LDS (MQ_BK + 8)    /* halves a shared-memory row: 144 bytes */
#define MQ_GROUPS (MQ_BN * MQ_BK / 8 / (MQ_WARPS * 32)) /* groups of 8 a thread dequantizes a step: 4 */

__device__ __forceinline__ void mq_ldsm4(uint32_t (&r)[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(mq_saddr(p)));
}

__device__ __forceinline__ uint32_t mq_h2(float lo, float hi)
{
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&h);
}

/* The warp grid of a BM-row block: 8 warps as WN (along the weight rows) x WM (along the
 * token rows); a warp's piece is MT m16 tiles x NT n8 tiles. */
template <int BM> struct mq_shape {
    enum {
        WN = BM <= 32 ? 8 : 4,
        WM = MQ_WARPS / WN,
        MT = MQ_BN / WN / 16,
        NT = BM / WM / 8,
        XC = BM * (MQ_BK / 8) / (MQ_WARPS * 32) /* 16-byte pieces of the x tile a thread (0: fewer threads) */
    };
    static_assert(NT % 2 == 0, "B fragments are loaded two n8 tiles at a time");
};


/* Shared memory of a block: the F16 weight tile (MQ_BN x MQ_BK), the F16 x tile (BM x
 * MQ_BK), and where staged two chunks of raw weights (MQ_BN x RB each). */
template <int T, int BM, bool STAGED> struct mq_smem {
    enum {
        W = MQ_BN * MQ_LDS * 2,
        X = BM * MQ_LDS * 2,
        RAW = STAGED ? 2 * MQ_BN * mq_stage<T>::RB : 0,
        /* two of each tile (DB: one barrier a step instead of two) where two blocks still
         * fit an SM's 228 KB (1 KB of each block is the system's) */
        DB = 2 * (2 * (W + X) + RAW + 1024) <= 228 * 1024,
        TILES = DB ? 2 : 1,
        BYTES = TILES * (W + X) + RAW
    };
};

/* Bits 0..3 of b spread to bit 4 of bytes 0..3 (Q5's fifth bits). */
__device__ __forceinline__ uint32_t mq_spread4(uint32_t b) { return ((b & 15u) * 0x00204081u & 0x01010101u) << 4; }

/* The 32 elements e .. e+31 (e a multiple of 32: one block of the 32-element types, one
 * sub-block of Q4_K, two scale groups of Q6_K) of a staged chunk row p (16-byte aligned):
 * the q of m40k_group8 as bytes, t[0..3] elements 0-15 and t[4..7] elements 16-31 (4 a
 * word, in order), and the scale and offset of each half; read with the widest loads each
 * layout's alignment allows, the scales decoded once for all 32. j: Q6_K_G8's superblock
 * within its group (its d; Q6_K_P's d follows its superblock). */
template <int T>
__device__ __forceinline__ void mq_deq32(const uint8_t *p, int e, int j, uint32_t (&t)[8], float (&sc)[2],
                                         float (&off)[2])
{
    if constexpr (T == M40K_TYPE_Q4_0 || T == M40K_TYPE_Q5_0) {
        /* 18- and 22-byte blocks at even offsets: 2-byte loads; element i < 16 is the low
         * nibble of byte i, element 16 + i the high one */
        constexpr int BB = m40k_tinfo<T>::BB, QS = T == M40K_TYPE_Q5_0 ? 6 : 2;
        const uint8_t *b = p + BB * (e >> 5);
        uint32_t v[4];
#pragma unroll
        for (int k = 0; k < 4; k++)
            v[k] = mq_lds16(b + QS + 4 * k) | mq_lds16(b + QS + 4 * k + 2) << 16;
        uint32_t hb = 0;
        if constexpr (T == M40K_TYPE_Q5_0)
            hb = mq_lds16(b + 2) | mq_lds16(b + 4) << 16;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            t[k] = v[k] & 0x0F0F0F0Fu;
            t[4 + k] = (v[k] >> 4) & 0x0F0F0F0Fu;
            if constexpr (T == M40K_TYPE_Q5_0) {
                t[k] |= mq_spread4(hb >> (4 * k));
                t[4 + k] |= mq_spread4(hb >> (16 + 4 * k));
            }
        }
        sc[0] = sc[1] = m40k_h2f((uint16_t)mq_lds16(b));
        off[0] = off[1] = (T == M40K_TYPE_Q5_0 ? 16.0f : 8.0f) * sc[0];
    } else if constexpr (T == M40K_TYPE_Q8_0) {
        const uint8_t *b = p + 34 * (e >> 5);
#pragma unroll
        for (int k = 0; k < 8; k++)
            t[k] = (mq_lds16(b + 2 + 4 * k) | mq_lds16(b + 4 + 4 * k) << 16) ^ 0x80808080u; /* int8 + 128 */
        sc[0] = sc[1] = m40k_h2f((uint16_t)mq_lds16(b));
        off[0] = off[1] = 128.0f * sc[0];
    } else if constexpr (T == M40K_TYPE_Q4_1 || T == M40K_TYPE_Q5_1) {
        /* 4- and 8-byte aligned blocks: word loads */
        constexpr int BB = m40k_tinfo<T>::BB, QS = T == M40K_TYPE_Q4_1 ? 4 : 8;
        const uint8_t *b = p + BB * (e >> 5);
        const uint32_t dm = *reinterpret_cast<const uint32_t *>(b);
        const uint32_t *qs = reinterpret_cast<const uint32_t *>(b + QS);
        uint32_t hb = 0;
        if constexpr (T == M40K_TYPE_Q5_1)
            hb = *reinterpret_cast<const uint32_t *>(b + 4);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const uint32_t v = qs[k];
            t[k] = v & 0x0F0F0F0Fu;
            t[4 + k] = (v >> 4) & 0x0F0F0F0Fu;
            if constexpr (T == M40K_TYPE_Q5_1) {
                t[k] |= mq_spread4(hb >> (4 * k));
                t[4 + k] |= mq_spread4(hb >> (16 + 4 * k));
            }
        }
        sc[0] = sc[1] = m40k_h2f((uint16_t)(dm & 0xFFFFu));
        off[0] = off[1] = -m40k_h2f((uint16_t)(dm >> 16));
    } else if constexpr (T == M40K_TYPE_Q8_0_G8) {
        const int jb = e >> 5;
        const uint4 *q = reinterpret_cast<const uint4 *>(p + 16 + 32 * jb);
        const uint4 a = q[0], c = q[1];
        const uint32_t v[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
#pragma unroll
        for (int k = 0; k < 8; k++)
            t[k] = v[k] ^ 0x80808080u;
        sc[0] = sc[1] = m40k_h2f((uint16_t)mq_lds16(p + 2 * jb));
        off[0] = off[1] = 128.0f * sc[0];
    } else if constexpr (T == M40K_TYPE_Q4_K) {
        const int s = e >> 5, sh = (s & 1) ? 4 : 0;
        const uint32_t dm = *reinterpret_cast<const uint32_t *>(p);
        const uint8_t *scb = p + 4;
        int scv, mnv;
        if (s < 4) {
            scv = scb[s] & 63;
            mnv = scb[s + 4] & 63;
        } else {
            scv = (scb[s + 4] & 15) | ((scb[s - 4] >> 6) << 4);
            mnv = (scb[s + 4] >> 4) | ((scb[s] >> 6) << 4);
        }
        const uint4 *q = reinterpret_cast<const uint4 *>(p + 16 + 32 * (s >> 1));
        const uint4 a = q[0], c = q[1];
        const uint32_t v[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
#pragma unroll
        for (int k = 0; k < 8; k++)
            t[k] = (v[k] >> sh) & 0x0F0F0F0Fu;
        sc[0] = sc[1] = m40k_h2f((uint16_t)(dm & 0xFFFFu)) * (float)scv;
        off[0] = off[1] = m40k_h2f((uint16_t)(dm >> 16)) * (float)mnv;
    } else if constexpr (T == M40K_TYPE_Q6_K_G8 || T == M40K_TYPE_Q6_K_P) {
        const int n = e >> 7, k = (e & 127) >> 5;
        const uint4 *ql = reinterpret_cast<const uint4 *>(p + 64 * n + 32 * (k & 1));
        const uint4 *qh = reinterpret_cast<const uint4 *>(p + 128 + 32 * n);
        const uint4 la = ql[0], lc = ql[1], ha = qh[0], hc = qh[1];
        const uint32_t lo[8] = {la.x, la.y, la.z, la.w, lc.x, lc.y, lc.z, lc.w};
        const uint32_t hi[8] = {ha.x, ha.y, ha.z, ha.w, hc.x, hc.y, hc.z, hc.w};
        const int shl = k < 2 ? 0 : 4, shh = 2 * k;
#pragma unroll
        for (int i = 0; i < 8; i++)
            t[i] = ((lo[i] >> shl) & 0x0F0F0F0Fu) | (((hi[i] >> shh) & 0x03030303u) << 4);
        const float d = m40k_h2f((uint16_t)mq_lds16(p + 208 + (T == M40K_TYPE_Q6_K_G8 ? 2 * j : 0)));
#pragma unroll
        for (int h = 0; h < 2; h++) {
            sc[h] = d * (float)(int8_t)p[192 + (e >> 4) + h];
            off[h] = 32.0f * sc[h];
        }
    }
}

/* STAGED: the weights come through two chunk buffers filled by cp.async a chunk (four
 * steps) ahead and are dequantized from shared memory (mq_deq32; K a multiple of 256, rows
 * 16-byte aligned); otherwise each thread dequantizes straight from global memory
 * (m40k_group8, any alignment: the fallback). The next step's tiles are formed in
 * registers before a step's multiply. Where two blocks an SM still fit with two buffers of
 * the F16 tiles (mq_smem::DB) a step is multiply, store the next tiles into the other
 * buffer, barrier; otherwise multiply, barrier, store, barrier. Registers: blocks of 16
 * or 32 token rows are held to 85 a thread (three blocks an SM; they used 84-86 before
 * the bound, with no spills under it), larger ones to 128 (two). */
/* The block's work: output tile (bx, by) of the product, split s of S (tile: its counter);
 * mq_kernel's blocks take it from their index, the grouped kernel of the experts
 * (mq_grouped_kernel) from its tile table. */
template <int T, int BM, bool STAGED>
__device__ __forceinline__ void mq_block(const uint8_t *__restrict__ w, size_t row_bytes, int N, int K,
                                         const uint16_t *__restrict__ x, int64_t x_stride, int M,
                                         float *__restrict__ y, int64_t ldy, int S, float *ws, int *counters, int bx,
                                         int by, int s, int tile)
{
    typedef mq_shape<BM> sh;
    typedef mq_smem<T, BM, STAGED> sm;
    constexpr int RB = STAGED ? mq_stage<T>::RB : 16;
    extern __shared__ __align__(16) uint8_t mq_sm[];
    /* tile buffer b (b < sm::TILES): weights at wt + b * MQ_BN * MQ_LDS, x at xt + b * BM * MQ_LDS */
    uint16_t *const wt = reinterpret_cast<uint16_t *>(mq_sm);
    uint16_t *const xt = reinterpret_cast<uint16_t *>(mq_sm + sm::TILES * sm::W);
    uint8_t *const raw = mq_sm + sm::TILES * (sm::W + sm::X); /* STAGED: chunk buffer b at raw + b * MQ_BN * RB */
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wn = warp % sh::WN, wm = warp / sh::WN;
    const int n0 = bx * MQ_BN, m0 = by * BM;
    /* the split's steps: whole chunks of 256 (the staged kernel's unit; the direct one
     * splits alike, so that both sum in the same order) */
    constexpr int unit = MQ_KC / MQ_BK;
    const int nu = (K + MQ_KC - 1) / MQ_KC;
    const int it0 = (int)((int64_t)s * nu / S) * unit, it1 = min((int)((int64_t)(s + 1) * nu / S) * unit,
                                                                 (K + MQ_BK - 1) / MQ_BK);

    /* this thread's groups: group i*256 + tid of the tile is row g >> 3, columns 8*(g & 7) */
    /* Direct: group i*256 + tid of the tile is row g >> 3, columns 8*(g & 7). Staged: one
     * run of 32 a thread, row tid >> 1, columns 32*(tid & 1) .. +31 (the four groups). */
    int wr[MQ_GROUPS], wcol[MQ_GROUPS];
#pragma unroll
    for (int i = 0; i < MQ_GROUPS; i++) {
        const int g = i * MQ_WARPS * 32 + tid;
        wr[i] = STAGED ? tid >> 1 : g >> 3;
        wcol[i] = STAGED ? 32 * (tid & 1) + 8 * i : 8 * (g & 7);
    }
    static_assert(!STAGED || (MQ_GROUPS == 4 && MQ_BN * MQ_BK == 32 * MQ_WARPS * 32), "one run of 32 a thread");
    /* STAGED: chunk c (of the row's chunks) into buffer c & 1, one commit group */
    auto issue_chunk = [&](int c) {
        uint8_t *dst = raw + (c & 1) * MQ_BN * RB;
        for (int i = tid; i < MQ_BN * (RB / 16); i += MQ_WARPS * 32) {
            const int r = i / (RB / 16), o = 16 * (i % (RB / 16));
            const uint8_t *row = w + (size_t)min(n0 + r, N - 1) * row_bytes; /* rows past N: never written */
            mq_cp16(dst + r * RB + o, mq_chunk_src<T>(row, c, o), 16);
        }
        mq_commit();
    };
    /* the weight tile of step it as F16, packed: 4 groups x 8 halves */
    auto deq = [&](int it, uint4(&h)[MQ_GROUPS]) {
        if constexpr (STAGED) {
            const int e0 = it * MQ_BK + wcol[0], c = e0 / MQ_KC;
            uint32_t t[8];
            float sc[2], off[2];
            mq_deq32<T>(raw + (c & 1) * MQ_BN * RB + wr[0] * RB, e0 % MQ_KC, c & 7, t, sc, off);
#pragma unroll
            for (int i = 0; i < MQ_GROUPS; i++) {
                uint32_t qh[4];
                mq_bytes_h2(t[2 * i], t[2 * i + 1], qh);
                h[i] = mq_pack(qh, sc[i >> 1], off[i >> 1]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < MQ_GROUPS; i++) {
                const int e0 = it * MQ_BK + wcol[i];
                float q[8], sc = 0.0f, off = 0.0f;
#pragma unroll
                for (int k = 0; k < 8; k++)
                    q[k] = 0.0f;
                if (e0 < K)
                    m40k_group8<T>(w + (size_t)min(n0 + wr[i], N - 1) * row_bytes, e0, q, sc, off);
                uint32_t qh[4];
#pragma unroll
                for (int k = 0; k < 4; k++)
                    qh[k] = mq_h2(q[2 * k], q[2 * k + 1]); /* small integers and F16 values exact; BF16 rounded */
                h[i] = mq_pack(qh, sc, off);
            }
        }
    };
    /* the x tile of step it into registers: BM rows x 8 pieces of 16 bytes; rows past M
     * and columns past K are zeros */
    constexpr int XC = sh::XC > 0 ? sh::XC : 1;
    auto load_x = [&](int it, uint4(&h)[XC]) {
#pragma unroll
        for (int i = 0; i < XC; i++) {
            const int c = i * MQ_WARPS * 32 + tid, r = c >> 3, k = it * MQ_BK + 8 * (c & 7);
            h[i] = make_uint4(0, 0, 0, 0);
            if (c < BM * (MQ_BK / 8) && m0 + r < M && k < K)
                h[i] = __ldg(reinterpret_cast<const uint4 *>(x + (size_t)(m0 + r) * x_stride + k));
        }
    };
    /* the tiles of step it into their buffer ((it - it0) & 1 with two, else the one) */
    auto buf = [&](int it) { return sm::DB ? (it - it0) & 1 : 0; };
    auto store = [&](int it, const uint4(&hw)[MQ_GROUPS], const uint4(&hx)[XC]) {
        uint16_t *const wb = wt + buf(it) * MQ_BN * MQ_LDS, *const xb = xt + buf(it) * BM * MQ_LDS;
#pragma unroll
        for (int i = 0; i < MQ_GROUPS; i++)
            *reinterpret_cast<uint4 *>(wb + wr[i] * MQ_LDS + wcol[i]) = hw[i];
#pragma unroll
        for (int i = 0; i < XC; i++) {
            const int c = i * MQ_WARPS * 32 + tid;
            if (c < BM * (MQ_BK / 8))
                *reinterpret_cast<uint4 *>(xb + (c >> 3) * MQ_LDS + 8 * (c & 7)) = hx[i];
        }
    };

    float acc[sh::MT][sh::NT][4];
#pragma unroll
    for (int a = 0; a < sh::MT; a++)
#pragma unroll
        for (int b = 0; b < sh::NT; b++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                acc[a][b][c] = 0.0f;

    /* x comes two steps ahead (hx0 / hx1 in turn): its loads have a whole step to land.
     * Not for 128-row blocks: their registers are full (the second buffer spilled). */
    constexpr bool X2 = BM < 128;
    uint4 hw[MQ_GROUPS], hx0[XC], hx1[X2 ? XC : 1];
    if (it0 < it1) {
        if constexpr (STAGED) { /* the first two chunks in flight together; wait for the first */
            issue_chunk(it0 / unit);
            if (it0 + unit < it1) {
                issue_chunk(it0 / unit + 1);
                mq_wait<1>();
            } else {
                mq_wait<0>();
            }
            __syncthreads();
        }
        load_x(it0, hx0);
        deq(it0, hw);
        store(it0, hw, hx0);
        if (X2 && it0 + 1 < it1)
            load_x(it0 + 1, hx0);
        __syncthreads();
    }
    /* A fragments: lanes 0-15 rows 0-15 at k, lanes 16-31 the same rows at k + 8; B
     * fragments (two n8 tiles): lane l row 8*(l >> 4) + (l & 7), k + 8*((l >> 3) & 1) */
    const int a_off = (wn * sh::MT * 16 + (lane & 15)) * MQ_LDS + (lane >> 4) * 8;
    const int b_off = (wm * sh::NT * 8 + ((lane >> 4) << 3) + (lane & 7)) * MQ_LDS + ((lane >> 3) & 1) * 8;
    /* step it: hn holds x of step it + 1 (X2; else it is loaded here), hl receives x of
     * step it + 2 */
    auto step = [&](int it, uint4(&hn)[XC], uint4(&hl)[X2 ? XC : 1]) {
        const bool more = it + 1 < it1;
        if constexpr (X2) {
            if (it + 2 < it1)
                load_x(it + 2, hl);
        } else if (more) {
            load_x(it + 1, hn);
        }
        if (more) {
            if constexpr (STAGED)
                if ((it + 1) % unit == 0) { /* step it + 1 opens chunk c: it was issued a chunk ago */
                    const int c = (it + 1) / unit;
                    mq_wait<0>();
                    __syncthreads();
                    /* chunk c + 1 into the buffer of chunk c - 1, read for the last time by
                     * the step before this one's (a barrier ago at least; chunk it0/unit + 1
                     * came with the first) */
                    if (it + 1 + unit < it1)
                        issue_chunk(c + 1);
                }
            deq(it + 1, hw);
        }
        const uint16_t *const wb = wt + buf(it) * MQ_BN * MQ_LDS, *const xb = xt + buf(it) * BM * MQ_LDS;
#pragma unroll
        for (int kk = 0; kk < MQ_BK; kk += 16) {
            uint32_t a[sh::MT][4], b[sh::NT][2];
#pragma unroll
            for (int mt = 0; mt < sh::MT; mt++)
                mq_ldsm4(a[mt], wb + a_off + mt * 16 * MQ_LDS + kk);
#pragma unroll
            for (int nt = 0; nt < sh::NT; nt += 2) {
                uint32_t r[4];
                mq_ldsm4(r, xb + b_off + nt * 8 * MQ_LDS + kk);
                b[nt][0] = r[0], b[nt][1] = r[1], b[nt + 1][0] = r[2], b[nt + 1][1] = r[3];
            }
#pragma unroll
            for (int mt = 0; mt < sh::MT; mt++)
#pragma unroll
                for (int nt = 0; nt < sh::NT; nt++)
                    mq_mma(acc[mt][nt], a[mt], b[nt][0], b[nt][1]);
        }
        if (more) {
            if constexpr (sm::DB) {
                /* the next step's tiles into the other buffer (its last reader, step it - 1,
                 * is a barrier behind), then one barrier: they are complete, and this
                 * step's buffer is free for the step after */
                store(it + 1, hw, hn);
                __syncthreads();
            } else {
                __syncthreads(); /* every warp is done with this step's tiles */
                store(it + 1, hw, hn);
                __syncthreads();
            }
        }
    };
    if constexpr (X2) {
        for (int it = it0; it < it1; it += 2) { /* two steps a turn: the x buffers swap roles */
            step(it, hx0, hx1);
            if (it + 1 < it1)
                step(it + 1, hx1, hx0);
        }
    } else {
        for (int it = it0; it < it1; it++)
            step(it, hx0, hx1);
    }

    /* accumulator c of tile (mt, nt): weight row 16*mt + lane/4 + 8*(c >> 1), token row
     * 8*nt + 2*(lane & 3) + (c & 1) of the warp's piece */
    float *dst = S > 1 ? ws + (size_t)s * M * N : y;
    const int64_t ld = S > 1 ? N : ldy;
#pragma unroll
    for (int mt = 0; mt < sh::MT; mt++)
#pragma unroll
        for (int nt = 0; nt < sh::NT; nt++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int r = n0 + wn * sh::MT * 16 + mt * 16 + (lane >> 2) + 8 * (c >> 1);
                const int t = m0 + wm * sh::NT * 8 + nt * 8 + 2 * (lane & 3) + (c & 1);
                if (r < N && t < M)
                    dst[(size_t)t * ld + r] = acc[mt][nt][c];
            }
    if (S > 1)
        mq_split_end(S, N, M, n0, m0, min(MQ_BN, N - n0), min(BM, M - m0), y, ldy, ws, counters, tile);
}

template <int T, int BM, bool STAGED>
__global__ __launch_bounds__(MQ_WARPS * 32, BM <= 32 ? 3 : 2) void mq_kernel(const uint8_t *__restrict__ w, size_t row_bytes, int N,
                                                               int K, const uint16_t *__restrict__ x, int64_t x_stride,
                                                               int M, float *__restrict__ y, int64_t ldy, int S,
                                                               float *ws, int *counters)
{
    mq_block<T, BM, STAGED>(w, row_bytes, N, K, x, x_stride, M, y, ldy, S, ws, counters, blockIdx.x, blockIdx.y,
                            blockIdx.z, blockIdx.y * gridDim.x + blockIdx.x);
}

/* The experts' grouped product (kernels.h 10g): block (bx, i) takes tile i of the table,
 * (expert e, its first row m0), and computes weight rows bx*128.. of expert e for the rows
 * m0 .. m0+BM of e's group (rows offsets[e] .. offsets[e+1] of x and y) as mq_kernel's
 * block (bx, m0/BM) of that expert's product. Entries with e outside [0, n_expert): no
 * work (the table's unused tail). No split of K: the tiles fill the GPU. */
template <int T, int BM, bool STAGED>
__global__ __launch_bounds__(MQ_WARPS * 32, BM <= 32 ? 3 : 2) void mq_grouped_kernel(
    const uint8_t *__restrict__ w, size_t row_bytes, size_t expert_bytes, int n_expert, int N, int K,
    const uint16_t *__restrict__ x, int64_t x_stride, const int32_t *__restrict__ offsets,
    const int32_t *__restrict__ tiles, float *__restrict__ y, int64_t ldy)
{
    int e, m0, base, M;
    if (!mq_group_tile(tiles, offsets, n_expert, blockIdx.y, e, m0, base, M))
        return;
    mq_block<T, BM, STAGED>(w + (size_t)e * expert_bytes, row_bytes, N, K, x + (size_t)base * x_stride, x_stride, M,
                            y + (size_t)base * ldy, ldy, 1, nullptr, nullptr, blockIdx.x, m0 / BM, 0, 0);
}

/* The weights as F16, for products of many rows (prefill chunks) that multiply them with
 * cuBLAS (m40k_gemm_q_dequant). A tile is one 256-element chunk of MQ_DQ_ROWS rows: its
 * raw chunk rows staged in shared memory by 16-byte copies, a run of 32 a thread formed
 * (mq_deq32, as the staged kernel), the F16 results staged again so that a warp stores
 * 512 contiguous bytes of one row an instruction (each thread's 64 bytes stored straight
 * out, 16 bytes at a 64-byte stride a lane, ran at 1.3-1.8 TB/s of weights read plus F16
 * written against 2.0-2.55 this way on an H100: BENCHMARKS.md). The grid is what fits on
 * the GPU at once, each block walking tiles with the next tile's raw bytes copied
 * (cp.async) while it forms and stores this one: a block that loaded, formed and stored
 * one tile and ended left DRAM idle between its phases. Tiles go chunk-fastest, so the
 * blocks running at once read and write whole rows. */
#define MQ_DQ_ROWS 32
#define MQ_DQ_OUT_LD (MQ_KC * 2 + 16) /* bytes a staged output row (16 of padding) */
template <int T>
__global__ __launch_bounds__(256) void mq_dequant_kernel(const uint8_t *__restrict__ w, size_t row_bytes, int N,
                                                           int K, uint16_t *__restrict__ out)
{
    /* NS: tiles in the ring (a third stage measured no faster on an H200, BENCHMARKS.md) */
    constexpr int RB = mq_stage<T>::RB, NS = 2;
    __shared__ __align__(16) uint8_t raw[NS][MQ_DQ_ROWS * RB];
    __shared__ __align__(16) uint8_t o16[MQ_DQ_ROWS * MQ_DQ_OUT_LD];
    const int nc = K / MQ_KC, tiles = (N + MQ_DQ_ROWS - 1) / MQ_DQ_ROWS * nc;
    auto issue = [&](int t, int b) {
        const int n0 = t / nc * MQ_DQ_ROWS, c = t % nc;
        for (int i = threadIdx.x; i < MQ_DQ_ROWS * (RB / 16); i += blockDim.x) {
            const int r = i / (RB / 16), o = 16 * (i % (RB / 16));
            const uint8_t *row = w + (size_t)min(n0 + r, N - 1) * row_bytes;
            mq_cp16(raw[b] + r * RB + o, mq_chunk_src<T>(row, c, o), 16);
        }
        mq_commit();
    };
    const int G = gridDim.x;
    int t = blockIdx.x, b = 0;
#pragma unroll
    for (int s = 0; s < NS - 1; s++)
        if (t + s * G < tiles)
            issue(t + s * G, s);
        else
            mq_commit(); /* empty groups keep the count of the waits below */
    for (; t < tiles; t += G, b = b + 1 == NS ? 0 : b + 1) {
        /* the buffer of the tile formed last: every thread formed it before the last barrier */
        const int ahead = t + (NS - 1) * G, bn = b == 0 ? NS - 1 : b - 1;
        if (ahead < tiles)
            issue(ahead, bn);
        else
            mq_commit();
        mq_wait<NS - 1>();
        __syncthreads(); /* tile t's raw bytes from every thread; the last tile's stores read o16 */
        const int n0 = t / nc * MQ_DQ_ROWS, c = t % nc;
        {
            const int r = threadIdx.x >> 3, e = 32 * (threadIdx.x & 7);
            uint32_t q[8];
            float sc[2], off[2];
            mq_deq32<T>(raw[b] + r * RB, e, c & 7, q, sc, off);
            uint4 *o = reinterpret_cast<uint4 *>(o16 + r * MQ_DQ_OUT_LD + 2 * e);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                uint32_t qh[4];
                mq_bytes_h2(q[2 * i], q[2 * i + 1], qh);
                o[i] = mq_pack(qh, sc[i >> 1], off[i >> 1]);
            }
        }
        __syncthreads();
        /* row r = idx / 32, 16-byte piece idx % 32: a warp one row's 512 bytes */
#pragma unroll
        for (int k = 0; k < MQ_DQ_ROWS * 32 / 256; k++) {
            const int idx = threadIdx.x + 256 * k, r = idx >> 5, p = idx & 31;
            if (n0 + r < N)
                *reinterpret_cast<uint4 *>(out + (size_t)(n0 + r) * K + (size_t)c * MQ_KC + 8 * p) =
                    *reinterpret_cast<const uint4 *>(o16 + r * MQ_DQ_OUT_LD + 16 * p);
        }
    }
    mq_wait<0>();
}

/* blocks of mq_dequant_kernel<T> that run at once on the current device (the SMs times
 * the blocks an SM holds), asked once per device */
template <int T> static int mq_dequant_grid(void)
{
    static int grid[64];
    int dev = 0, per = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64)
        return 0;
    if (!grid[dev] && cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, mq_dequant_kernel<T>, 256, 0) == cudaSuccess)
        grid[dev] = mq_sm_count() * (per > 0 ? per : 1);
    return grid[dev];
}

template <int T> static int mq_dequant_type(const void *w, int N, int K, uint16_t *out, cudaStream_t st)
{
    if constexpr (mq_stage<T>::STAGED) {
        typedef m40k_tinfo<T> ti;
        const size_t rb = m40k_row_bytes<T>(K);
        if (K % ti::BE || K % MQ_KC || rb % 16 || ((uintptr_t)w & 15) || ((uintptr_t)out & 15))
            return M40K_INVALID;
        const int64_t tiles = (int64_t)((N + MQ_DQ_ROWS - 1) / MQ_DQ_ROWS) * (K / MQ_KC);
        if (tiles > INT32_MAX)
            return M40K_INVALID;
        if (tiles == 0)
            return 0;
        const int fit = mq_dequant_grid<T>();
        const unsigned grid = (unsigned)(fit > 0 && tiles > fit ? fit : tiles);
        mq_dequant_kernel<T><<<grid, 256, 0, st>>>((const uint8_t *)w, rb, N, K, out);
        return m40k_launch_status();
    }
    return M40K_INVALID;
}

/* The block's token rows for M rows: the smallest of 16, 32, 64 that holds them, else 128. */
static int mq_bm(int M) { return M <= 16 ? 16 : M <= 32 ? 32 : M <= 64 ? 64 : 128; }

/* tiles of the staged kernel (MQ_BN weight rows by mq_bm(M) token rows) */
static size_t mq_tiles(int N, int M)
{
    return N > 0 && M > 0 ? (size_t)((N + MQ_BN - 1) / MQ_BN) * (size_t)((M + mq_bm(M) - 1) / mq_bm(M)) : 0;
}

/* a counter a tile: the staged kernel's, or the register kernel's (blocks of 96 rows or more) */
extern "C" size_t m40k_gemm_q_counter_ints(int N, int M)
{
    const size_t reg = N > 0 && M > 0 ? (size_t)((N + MR_MIN_ROWS - 1) / MR_MIN_ROWS) : 0;
    return mq_tiles(N, M) > reg ? mq_tiles(N, M) : reg;
}

extern "C" size_t m40k_gemm_q_ws_floats(int N, int M, int n_splits)
{
    return n_splits > 1 && N > 0 && M > 0 ? (size_t)n_splits * M * N : 0;
}

/* Products of up to this many token rows take the register kernel where it reads the
 * type (m40k_gemm_q_tune). */
static int mq_reg_rows = 64;

extern "C" void m40k_gemm_q_tune(int reg_rows) { mq_reg_rows = reg_rows < 0 ? 0 : reg_rows; }

/* Tiles of up to this many rows of the experts' grouped product take the register
 * kernel's grouped kernel where it reads the type (m40k_moe_gemm_q_tune). */
static int mq_reg_rows_grouped = 64;

extern "C" void m40k_moe_gemm_q_tune(int reg_rows) { mq_reg_rows_grouped = reg_rows < 0 ? 0 : reg_rows; }

static bool mq_reg_takes(int w_type, int K, int M, const void *w, size_t row_bytes)
{
    return M <= mq_reg_rows && mr_reads(w_type, K, M, w, row_bytes);
}

extern "C" int m40k_gemm_q_pick_splits(int w_type, int N, int K, int M, int sm_count, size_t ws_floats,
                                       size_t counter_ints)
{
    if (N <= 0 || M <= 0 || K <= 0 || sm_count <= 0 || m40k_gemm_q_counter_ints(N, M) > counter_ints)
        return 1;
    const int tiles = (int)mq_tiles(N, M), nc = (K + MQ_KC - 1) / MQ_KC;
    /* one wave of two resident blocks an SM (the register kernel: its own count); at
     * least one 256-wide chunk a split */
    int S = mq_reg_takes(w_type, K, M, NULL, 16) ? mr_pick_splits(w_type, N, K, M, sm_count) : (2 * sm_count) / tiles;
    S = min(S, nc);
    while (S > 1 && m40k_gemm_q_ws_floats(N, M, S) > ws_floats)
        S--;
    return S < 1 ? 1 : S;
}

/* Raises the dynamic shared-memory limit of instance <T, BM, STAGED> on the current
 * device, once (a plain flag per device: a second thread racing here only sets it twice). */
template <int T, int BM, bool STAGED> static int mq_prepare(void)
{
    static bool done[64];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64)
        return M40K_INVALID;
    if (!done[dev]) {
        const cudaError_t e = cudaFuncSetAttribute(mq_kernel<T, BM, STAGED>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   mq_smem<T, BM, STAGED>::BYTES);
        if (e != cudaSuccess)
            return (int)e;
        done[dev] = true;
    }
    return 0;
}

template <int T, bool STAGED> static int mq_prepare_all(void)
{
    int e = mq_prepare<T, 16, STAGED>();
    if (!e)
        e = mq_prepare<T, 32, STAGED>();
    if (!e)
        e = mq_prepare<T, 64, STAGED>();
    if (!e)
        e = mq_prepare<T, 128, STAGED>();
    return e;
}

template <int T> static int mq_prepare_type(void)
{
    int e = mq_prepare_all<T, false>();
    if constexpr (mq_stage<T>::STAGED)
        if (!e)
            e = mq_prepare_all<T, true>();
    return e;
}

template <int T, int BM, bool STAGED>
static int mq_launch(const void *w, size_t row_bytes, int N, int K, const uint16_t *x, int64_t x_stride, int M,
                     float *y, int64_t ldy, int S, float *ws, int *counters, cudaStream_t st)
{
    const int e = mq_prepare<T, BM, STAGED>();
    if (e)
        return e;
    const dim3 grid((unsigned)((N + MQ_BN - 1) / MQ_BN), (unsigned)((M + BM - 1) / BM), (unsigned)S);
    mq_kernel<T, BM, STAGED><<<grid, MQ_WARPS * 32, mq_smem<T, BM, STAGED>::BYTES, st>>>(
        (const uint8_t *)w, row_bytes, N, K, x, x_stride, M, y, ldy, S, ws, counters);
    return m40k_launch_status();
}

template <int T, bool STAGED>
static int mq_bm_launch(const void *w, size_t rb, int N, int K, const uint16_t *x, int64_t x_stride, int M, float *y,
                        int64_t ldy, int S, float *ws, int *counters, cudaStream_t st)
{
    switch (mq_bm(M)) {
    case 16: return mq_launch<T, 16, STAGED>(w, rb, N, K, x, x_stride, M, y, ldy, S, ws, counters, st);
    case 32: return mq_launch<T, 32, STAGED>(w, rb, N, K, x, x_stride, M, y, ldy, S, ws, counters, st);
    case 64: return mq_launch<T, 64, STAGED>(w, rb, N, K, x, x_stride, M, y, ldy, S, ws, counters, st);
    default: return mq_launch<T, 128, STAGED>(w, rb, N, K, x, x_stride, M, y, ldy, S, ws, counters, st);
    }
}

/* The register kernel where it takes the product (gemm_q_reg.cu); else the staged kernel
 * where the type has 16-byte chunks and the rows allow them (K a multiple of 256, rows
 * 16-byte aligned); the direct one otherwise. */
template <int T> static int mq_kind(const void *w, int K, int M)
{
    const size_t rb = m40k_row_bytes<T>(K);
    if (mq_reg_takes(T, K, M, w, rb))
        return M40K_GEMM_Q_REGISTER;
    if constexpr (mq_stage<T>::STAGED)
        if (K % MQ_KC == 0 && rb % 16 == 0 && ((uintptr_t)w & 15) == 0)
            return M40K_GEMM_Q_STAGED;
    return M40K_GEMM_Q_DIRECT;
}

template <int T>
static int mq_type(const void *w, int N, int K, const uint16_t *x, int64_t x_stride, int M, float *y, int64_t ldy,
                   int S, float *ws, int *counters, cudaStream_t st)
{
    if (K % m40k_kstep<T>())
        return M40K_INVALID;
    const size_t rb = m40k_row_bytes<T>(K);
    switch (mq_kind<T>(w, K, M)) {
    case M40K_GEMM_Q_REGISTER: return mr_gemm(T, w, rb, N, K, x, x_stride, M, y, ldy, S, ws, counters, st);
    case M40K_GEMM_Q_STAGED:
        if constexpr (mq_stage<T>::STAGED)
            return mq_bm_launch<T, true>(w, rb, N, K, x, x_stride, M, y, ldy, S, ws, counters, st);
        return M40K_INVALID;
    default: return mq_bm_launch<T, false>(w, rb, N, K, x, x_stride, M, y, ldy, S, ws, counters, st);
    }
}

/* The types m40k_gemm_q reads: one list for the dispatch, the preparation and the
 * question whether a type is read. */
#define MQ_TYPES(X)                                                                                                    \
    X(M40K_TYPE_F16)                                                                                                   \
    X(M40K_TYPE_Q8_0)                                                                                                  \
    X(M40K_TYPE_Q4_0)                                                                                                  \
    X(M40K_TYPE_Q4_1)                                                                                                  \
    X(M40K_TYPE_Q5_0)                                                                                                  \
    X(M40K_TYPE_Q5_1)                                                                                                  \
    X(M40K_TYPE_Q4_K)                                                                                                  \
    X(M40K_TYPE_Q6_K)                                                                                                  \
    X(M40K_TYPE_Q8_0_G8)                                                                                               \
    X(M40K_TYPE_Q6_K_G8)                                                                                               \
    X(M40K_TYPE_Q6_K_P)                                                                                                \
    X(M40K_TYPE_MXFP4_P)                                                                                               \
    X(M40K_TYPE_Q2_K)                                                                                                  \
    X(M40K_TYPE_Q3_K)                                                                                                  \
    X(M40K_TYPE_Q5_K)                                                                                                  \
    X(M40K_TYPE_BF16)                                                                                                  \
    X(M40K_TYPE_MXFP4)

extern "C" int m40k_gemm_q_supported(int w_type)
{
    switch (w_type) {
#define MQ_CASE(t) case t:
        MQ_TYPES(MQ_CASE)
#undef MQ_CASE
        return 1;
    default: return 0;
    }
}

extern "C" int m40k_gemm_q_kernel(int w_type, int K, int M, const void *w)
{
    if (K <= 0 || M <= 0)
        return M40K_INVALID;
    switch (w_type) {
#define MQ_CASE(t)                                                                                                     \
    case t: return K % m40k_kstep<t>() ? M40K_INVALID : mq_kind<t>(w, K, M);
        MQ_TYPES(MQ_CASE)
#undef MQ_CASE
    default: return M40K_INVALID;
    }
}

extern "C" int m40k_gemm_q_dequant(const void *w, int w_type, int N, int K, uint16_t *out, m40k_stream stream)
{
    if (N <= 0 || K <= 0)
        return N < 0 || K < 0 ? M40K_INVALID : 0;
    if (K / MQ_KC > 65535)
        return M40K_INVALID;
    switch (w_type) {
#define MQ_CASE(t)                                                                                                     \
    case t: return mq_dequant_type<t>(w, N, K, out, (cudaStream_t)stream);
        MQ_TYPES(MQ_CASE)
#undef MQ_CASE
    default: return M40K_INVALID;
    }
}

extern "C" int m40k_gemm_q_prepare(void)
{
    int e = mr_prepare();
#define MQ_PREP(t)                                                                                                     \
    if (!e)                                                                                                            \
        e = mq_prepare_type<t>();
    MQ_TYPES(MQ_PREP)
#undef MQ_PREP
    return e;
}

extern "C" int m40k_gemm_q(const void *w, int w_type, int N, int K, const uint16_t *x, int64_t x_stride, int M,
                           float *y, int64_t ldy, int n_splits, float *workspace, int *counters, m40k_stream stream)
{
    if (N <= 0 || M <= 0)
        return 0;
    if (K <= 0 || K % 8 || ((uintptr_t)x & 15) || x_stride % 8 || (M > 1 && x_stride < K) || ldy < N ||
        n_splits < 1 || n_splits > (K + MQ_KC - 1) / MQ_KC || n_splits > 65535 ||
        (n_splits > 1 && (!workspace || !counters)) || (M + 15) / 16 > 65535)
        return M40K_INVALID;
    cudaStream_t st = (cudaStream_t)stream;
    switch (w_type) {
#define MQ_CASE(t)                                                                                                     \
    case t: return mq_type<t>(w, N, K, x, x_stride, M, y, ldy, n_splits, workspace, counters, st);
        MQ_TYPES(MQ_CASE)
#undef MQ_CASE
    default: return M40K_INVALID;
    }
}

/* ---------------------------------------------------------------- grouped (experts) */

template <int T, int BM, bool STAGED>
static int mq_grouped_launch(const void *w, size_t rb, size_t eb, int n_expert, int N, int K, const uint16_t *x,
                             int64_t x_stride, const int32_t *offsets, const int32_t *tiles, int max_tiles, float *y,
                             int64_t ldy, cudaStream_t st)
{
    static bool done[64];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64)
        return M40K_INVALID;
    if (!done[dev]) {
        const cudaError_t e = cudaFuncSetAttribute(mq_grouped_kernel<T, BM, STAGED>,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   mq_smem<T, BM, STAGED>::BYTES);
        if (e != cudaSuccess)
            return (int)e;
        done[dev] = true;
    }
    const dim3 grid((unsigned)((N + MQ_BN - 1) / MQ_BN), (unsigned)max_tiles);
    mq_grouped_kernel<T, BM, STAGED><<<grid, MQ_WARPS * 32, mq_smem<T, BM, STAGED>::BYTES, st>>>(
        (const uint8_t *)w, rb, eb, n_expert, N, K, x, x_stride, offsets, tiles, y, ldy);
    return m40k_launch_status();
}

template <int T, bool STAGED>
static int mq_grouped_bm(int bm, const void *w, size_t rb, size_t eb, int n_expert, int N, int K, const uint16_t *x,
                         int64_t x_stride, const int32_t *offsets, const int32_t *tiles, int max_tiles, float *y,
                         int64_t ldy, cudaStream_t st)
{
    switch (bm) {
    case 16: return mq_grouped_launch<T, 16, STAGED>(w, rb, eb, n_expert, N, K, x, x_stride, offsets, tiles, max_tiles, y, ldy, st);
    case 32: return mq_grouped_launch<T, 32, STAGED>(w, rb, eb, n_expert, N, K, x, x_stride, offsets, tiles, max_tiles, y, ldy, st);
    case 64: return mq_grouped_launch<T, 64, STAGED>(w, rb, eb, n_expert, N, K, x, x_stride, offsets, tiles, max_tiles, y, ldy, st);
    case 128: return mq_grouped_launch<T, 128, STAGED>(w, rb, eb, n_expert, N, K, x, x_stride, offsets, tiles, max_tiles, y, ldy, st);
    default: return M40K_INVALID;
    }
}

/* The register kernel's grouped kernel where it reads the type (gemm_q_reg.cu); else
 * staged where the shared-memory kernel would stage this matrix (K a multiple of 256, rows
 * and every expert's matrix 16-byte aligned), direct otherwise. */
template <int T>
static int mq_grouped_type(const void *w, int n_expert, int N, int K, const uint16_t *x, int64_t x_stride,
                           const int32_t *offsets, const int32_t *tiles, int max_tiles, int bm, float *y, int64_t ldy,
                           cudaStream_t st)
{
    if (K % m40k_kstep<T>())
        return M40K_INVALID;
    const size_t rb = m40k_row_bytes<T>(K), eb = rb * (size_t)N;
    /* tiles of up to 64 rows in the register kernel's types take its grouped kernel, as a
     * product of that many rows would (every expert's matrix 16-byte aligned too) */
    if (bm <= 64 && bm <= mq_reg_rows_grouped && eb % 16 == 0 && mr_reads(T, K, bm, w, rb))
        return mr_grouped(T, w, rb, eb, n_expert, N, K, x, x_stride, offsets, tiles, max_tiles, bm, y, ldy, st);
    if constexpr (mq_stage<T>::STAGED)
        if (K % MQ_KC == 0 && rb % 16 == 0 && ((uintptr_t)w & 15) == 0)
            return mq_grouped_bm<T, true>(bm, w, rb, eb, n_expert, N, K, x, x_stride, offsets, tiles, max_tiles, y, ldy, st);
    return mq_grouped_bm<T, false>(bm, w, rb, eb, n_expert, N, K, x, x_stride, offsets, tiles, max_tiles, y, ldy, st);
}

extern "C" int m40k_moe_gemm_q(const void *w, int w_type, int n_expert, int N, int K, const uint16_t *x,
                               int64_t x_stride, const int32_t *offsets, const int32_t *tiles, int max_tiles, int bm,
                               float *y, int64_t ldy, m40k_stream stream)
{
    if (N <= 0 || max_tiles <= 0)
        return N < 0 || max_tiles < 0 ? M40K_INVALID : 0;
    if (K <= 0 || K % 8 || ((uintptr_t)x & 15) || x_stride % 8 || x_stride < K || ldy < N || n_expert <= 0 ||
        max_tiles > 65535 || (bm != 16 && bm != 32 && bm != 64 && bm != 128))
        return M40K_INVALID;
    cudaStream_t st = (cudaStream_t)stream;
    switch (w_type) {
#define MQ_CASE(t)                                                                                                     \
    case t: return mq_grouped_type<t>(w, n_expert, N, K, x, x_stride, offsets, tiles, max_tiles, bm, y, ldy, st);
        MQ_TYPES(MQ_CASE)
#undef MQ_CASE
    default: return M40K_INVALID;
    }
}
