/* Device pieces shared by the two kernels of the quantized GEMM (kernels.h 8e): the
 * shared-memory tile kernel (gemm_q.cu) and the register kernel (gemm_q_reg.cu). The
 * weights of both are F16(q * F16(scale) - F16(offset)), so one twin (m40_ref_gemm_q)
 * serves both; the split-K end is one function, so both sum their splits alike. */
#ifndef M40_GEMM_Q_DEV_H
#define M40_GEMM_Q_DEV_H

#include "quant_dev.h"

#define MQ_WARPS 8

__device__ __forceinline__ uint32_t mq_saddr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* 16 bytes global -> shared; src_bytes 0 writes zeros and reads nothing. cp.async is
 * sm_80's: the builds for older GPUs (which never launch this kernel: the engine asks for
 * cc >= 8.0) get plain copies so that they compile. */
__device__ __forceinline__ void mq_cp16(void *dst, const void *src, int src_bytes)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(mq_saddr(dst)), "l"(src), "r"(src_bytes)
                 : "memory");
#else
    *reinterpret_cast<uint4 *>(dst) = src_bytes ? *reinterpret_cast<const uint4 *>(src) : make_uint4(0, 0, 0, 0);
#endif
}
__device__ __forceinline__ void mq_commit(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
/* every copy issued so far has landed (N = 0), or all but the last N groups */
template <int N> __device__ __forceinline__ void mq_wait(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (N == 0)
        asm volatile("cp.async.wait_all;\n" ::: "memory");
    else
        asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

/* c[16x8] += a[16x16] b[16x8], F16 in, F32 accumulate (fragment layouts: PTX ISA,
 * mma.m16n8k16) */
__device__ __forceinline__ void mq_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

/* Staged weights (the fast path): per row and chunk of MQ_KC = 256 elements, the chunk's
 * bytes as the file lays them out, RB bytes a row (a multiple of 16, so cp.async moves
 * them 16 bytes at a time): one superblock of the K-quants, 8 blocks of the 32-element
 * types, one group of Q8_0_G8; Q6_K_G8's superblock (208 bytes) followed by its group's
 * 16 bytes of scales d[8]; Q6_K_P's padded superblock (224 bytes, its d at 208). 0: the
 * type has no such chunk (plain Q6_K: 210 bytes; Q2_K, Q3_K: 84, 110; MXFP4: 136) or
 * mq_deq32 does not read it yet (Q5_K, BF16): the direct kernel. STAGED: the shared-memory
 * kernel stages the type (MXFP4_P's chunks are the register kernel's only: products of
 * more rows take the direct kernel). */
#define MQ_KC 256
template <int T> struct mq_stage {
    enum {
        RB = T == M40K_TYPE_Q6_K_G8 ? 224
             : T == M40K_TYPE_Q6_K || T == M40K_TYPE_F16 || T == M40K_TYPE_F32 || T == M40K_TYPE_BF16 ||
                       T == M40K_TYPE_Q2_K || T == M40K_TYPE_Q3_K || T == M40K_TYPE_Q5_K || T == M40K_TYPE_MXFP4
                 ? 0
                 : MQ_KC / m40k_tinfo<T>::BE * m40k_tinfo<T>::BB,
        STAGED = RB > 0 && T != M40K_TYPE_MXFP4_P
    };
    static_assert(RB % 16 == 0, "staged chunks move in 16-byte pieces");
};

/* Where byte o of chunk c's staged row comes from in the weight row: the chunk's bytes,
 * or for Q6_K_G8 superblock c % 8 of group c / 8 followed by the group's d[8]. */
template <int T> __device__ __forceinline__ const uint8_t *mq_chunk_src(const uint8_t *row, int c, int o)
{
    if constexpr (T == M40K_TYPE_Q6_K_G8)
        return row + 1680 * (size_t)(c >> 3) + (o < 208 ? 208 * (c & 7) + o : 1664 + (o - 208));
    else
        return row + (size_t)c * mq_stage<T>::RB + o;
}

__device__ __forceinline__ uint32_t mq_lds16(const uint8_t *p) { return *reinterpret_cast<const uint16_t *>(p); }

/* The F16 weight of every element: w = RN(q * RN(scale) - RN(offset)), q, scale and
 * offset as m40k_group8 gives them, the scale and offset rounded to F16 once per group,
 * then one fused multiply-add in F16 (single rounding). For the types whose scale and
 * offset are F16 values already (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) that is exactly the F32
 * result rounded to F16; for Q4_K and Q6_K the rounded scale adds up to 2^-11 of the
 * weight's size, thirty times below the 4-bit grid. Two elements an instruction instead of
 * a conversion, a multiply-add and half a pack each in F32. Twin: m40_ref_gemm_q.
 * mq_pack_h2 takes the scale and the negated offset already in F16, each in both halves
 * (the register kernel forms them so); mq_pack rounds F32 ones. */
__device__ __forceinline__ uint4 mq_pack_h2(const uint32_t (&q)[4], __half2 s2, __half2 o2)
{
    uint4 h;
    uint32_t *o = &h.x;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const __half2 r = __hfma2(*reinterpret_cast<const __half2 *>(&q[i]), s2, o2);
        o[i] = *reinterpret_cast<const uint32_t *>(&r);
    }
    return h;
}

__device__ __forceinline__ uint4 mq_pack(const uint32_t (&q)[4], float sc, float off)
{
    return mq_pack_h2(q, __float2half2_rn(sc), __float2half2_rn(-off));
}

/* Two words of four unsigned bytes (each < 1024) as four F16 pairs holding them exactly:
 * the bytes under 0x64 (1024 + b), then 1024 subtracted. */
__device__ __forceinline__ void mq_bytes_h2(uint32_t t0, uint32_t t1, uint32_t (&q)[4])
{
    const __half2 k1024 = __halves2half2(__ushort_as_half(0x6400), __ushort_as_half(0x6400));
    const uint32_t v[4] = {__byte_perm(t0, 0x64, 0x4140), __byte_perm(t0, 0x64, 0x4342), __byte_perm(t1, 0x64, 0x4140),
                           __byte_perm(t1, 0x64, 0x4342)};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const __half2 r = __hsub2(*reinterpret_cast<const __half2 *>(&v[i]), k1024);
        q[i] = *reinterpret_cast<const uint32_t *>(&r);
    }
}

/* The end of a split-K block (S > 1): this block's partial tile is in ws (split s at
 * ws + s*M*N, [t][r]); it counts on its tile's counter, and the block that counts last
 * sums the S partials in order 0..S-1 (deterministic) into y and resets the counter to
 * zero. rows x toks: the tile's extent at (n0, m0). Every thread of the block calls it. */
__device__ __forceinline__ void mq_split_end(int S, int N, int M, int n0, int m0, int rows, int toks, float *y,
                                             int64_t ldy, const float *ws, int *counters, int tile)
{
    if (!m40k_split_last(counters + tile, S))
        return;
    if (rows % 4 == 0 && n0 % 4 == 0 && N % 4 == 0 && ldy % 4 == 0 && ((uintptr_t)y & 15) == 0 &&
        ((uintptr_t)ws & 15) == 0) {
        /* four rows a thread in 16-byte loads: a quarter of the rounds, each waiting on
         * the L2 for its S loads (at 64 token rows the 32 rounds of one float a thread were
         * most of a small product's time); the same sums in the same order */
        const int rq = rows / 4;
        for (int idx = threadIdx.x; idx < rq * toks; idx += blockDim.x) {
            const int t = m0 + idx / rq, r = n0 + 4 * (idx % rq);
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (int k = 0; k < S; k++) {
                const float4 p = __ldcg(reinterpret_cast<const float4 *>(ws + ((size_t)k * M + t) * N + r));
                v.x += p.x, v.y += p.y, v.z += p.z, v.w += p.w;
            }
            *reinterpret_cast<float4 *>(y + (size_t)t * ldy + r) = v;
        }
    } else {
        for (int idx = threadIdx.x; idx < rows * toks; idx += blockDim.x) {
            const int t = m0 + idx / rows, r = n0 + idx % rows;
            float v = 0.0f;
            for (int k = 0; k < S; k++)
                v += __ldcg(ws + ((size_t)k * M + t) * N + r);
            y[(size_t)t * ldy + r] = v;
        }
    }
    if (threadIdx.x == 0)
        atomicExch(counters + tile, 0); /* every split has counted: nothing else touches it now */
}

/* The tile of the experts' grouped product (kernels.h 10g) that block row i takes: tile i
 * of the table is (expert e, its first sorted row m0); base is the expert's first sorted
 * row and M its count. False where the block has no work (the table's unused tail, or m0
 * past the expert's rows): it returns before any barrier. */
__device__ __forceinline__ bool mq_group_tile(const int32_t *tiles, const int32_t *offsets, int n_expert, int i, int &e,
                                              int &m0, int &base, int &M)
{
    e = tiles[2 * i], m0 = tiles[2 * i + 1];
    if (e < 0 || e >= n_expert)
        return false;
    base = offsets[e], M = offsets[e + 1] - base;
    return m0 < M;
}

/* The chunk ring of the register-fragment kernels (gemm_q_reg.cu, gemm_x8.cu), chunks
 * c0 .. c1 - 1 through NS stages. They are launched with programmatic dependent launch:
 * the weights of the first NS - 1 chunks do not depend on the kernel before, so their
 * copies go out before the wait for it (one commit group a chunk: issue_w(c, stage)),
 * wait_x() waits for it and readies x's sources, then the x tiles (one group a chunk:
 * issue_x). The groups complete in order, so the loop's first wait, leaving NS - 2 groups
 * in flight, has every weight group and chunk c0's x landed; from there a turn issues
 * chunk c + NS - 1 into chunk c - 1's stage (one group, empty past the split's end) and
 * multiplies chunk c from its stage: chunk(c, stage). */
template <int NS, typename IW, typename WX, typename IX, typename CH>
__device__ __forceinline__ void mq_ring(int c0, int c1, IW &&issue_w, WX &&wait_x, IX &&issue_x, CH &&chunk)
{
#pragma unroll
    for (int i = 0; i < NS - 1; i++) {
        issue_w(c0 + i, i);
        mq_commit();
    }
    m40k_grid_launch_dependents();
    wait_x();
#pragma unroll
    for (int i = 0; i < NS - 1; i++) {
        issue_x(c0 + i, i);
        mq_commit();
    }
    for (int c = c0; c < c1; c++) {
        mq_wait<NS - 2>(); /* chunk c has landed (this thread's copies) */
        __syncthreads();   /* everyone's copies of chunk c; everyone is done with chunk c - 1 */
        issue_w(c + NS - 1, (c + NS - 1 - c0) % NS);
        issue_x(c + NS - 1, (c + NS - 1 - c0) % NS);
        mq_commit();
        chunk(c, (c - c0) % NS);
    }
    mq_wait<0>(); /* no copy outlives the block */
}

/* The end of the register-fragment kernels (gemm_q_reg.cu, gemm_x8.cu): a warp's m16 tile
 * of weight rows by NT n8 tiles of token rows, accumulator c of tile nt at weight row
 * n0 + wrow + 8*(c >> 1), token row 8*nt + 2*t4 + (c & 1), stored to y (or split s's
 * partial in ws), then the split-K end. rows: the block's weight rows; active: whether
 * this warp's tile is among them (every thread takes the split-K end). */
template <int NT>
__device__ __forceinline__ void mq_frag_store(const float (&acc)[NT][4], int n0, int rows, int wrow, int t4, int N,
                                              int M, float *y, int64_t ldy, int S, int s, float *ws, int *counters,
                                              bool active = true)
{
    float *dst = S > 1 ? ws + (size_t)s * M * N : y;
    const int64_t ld = S > 1 ? N : ldy;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int r = n0 + wrow + 8 * (c >> 1);
            const int t = nt * 8 + 2 * t4 + (c & 1);
            if (active && r < N && t < M)
                dst[(size_t)t * ld + r] = acc[nt][c];
        }
    if (S > 1)
        mq_split_end(S, N, M, n0, 0, min(rows, N - n0), M, y, ldy, ws, counters, blockIdx.x);
}

/* The token tile of the register-fragment kernels for M rows: 16, 32 or 64. */
static inline int mq_frag_bm(int M) { return M <= 16 ? 16 : M <= 32 ? 32 : 64; }

/* One wave: as many splits as fill the SMs with the blocks an SM holds (blocks of rows
 * weight rows), at most one a chunk of 256. (Half or twice that: slower or equal at 16-64
 * rows, BENCHMARKS.md.) */
static inline int mq_one_wave_splits(int blocks_per_sm, int sm_count, int N, int rows, int K)
{
    const int S = min(blocks_per_sm * sm_count / ((N + rows - 1) / rows), K / MQ_KC);
    return S < 1 ? 1 : S;
}

/* the SMs of the current device, asked once per device (0: unknown) */
static inline int mq_sm_count(void)
{
    static int count[64];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64)
        return 0;
    if (!count[dev] && cudaDeviceGetAttribute(&count[dev], cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
        count[dev] = 0;
    return count[dev];
}

/* prepare() once per device (a plain flag per device: a second thread racing here only
 * runs it twice): the kernels' shared-memory limits, before any launch or capture. */
template <typename F> static inline int mq_once_per_device(bool (&done)[64], F prepare)
{
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64)
        return M40K_INVALID;
    if (done[dev])
        return 0;
    const int e = prepare();
    done[dev] = !e;
    return e;
}

/* the dynamic shared-memory limit of three instances (token tiles of 16, 32, 64) */
template <typename K16, typename K32, typename K64>
static inline int mq_smem_limits(K16 k16, int b16, K32 k32, int b32, K64 k64, int b64)
{
    cudaError_t e = cudaFuncSetAttribute(k16, cudaFuncAttributeMaxDynamicSharedMemorySize, b16);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(k32, cudaFuncAttributeMaxDynamicSharedMemorySize, b32);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(k64, cudaFuncAttributeMaxDynamicSharedMemorySize, b64);
    return (int)e;
}

/* The register kernel (gemm_q_reg.cu): whether it takes a product (its types, 1..64 token
 * rows, aligned rows and K whole chunks), its split count, its shared-memory limits
 * (mr_prepare), the launch. */
int mr_reads(int w_type, int K, int M, const void *w, size_t row_bytes);
/* the fewest weight rows a register kernel's block takes (six of its eight warps multiply) */
#define MR_MIN_ROWS 96
int mr_pick_splits(int w_type, int N, int K, int M, int sm_count);
int mr_prepare(void);
int mr_gemm(int w_type, const void *w, size_t row_bytes, int N, int K, const uint16_t *x, int64_t x_stride, int M,
            float *y, int64_t ldy, int S, float *ws, int *counters, cudaStream_t st);
/* Its grouped product of the experts (m40k_moe_gemm_q where mr_reads the type and the
 * tiles are at most 64 rows: bm 16, 32 or 64). */
int mr_grouped(int w_type, const void *w, size_t row_bytes, size_t expert_bytes, int n_expert, int N, int K,
               const uint16_t *x, int64_t x_stride, const int32_t *offsets, const int32_t *tiles, int max_tiles, int bm,
               float *y, int64_t ldy, cudaStream_t st);

#endif
