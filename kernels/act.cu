/* Elementwise: gated activations (SwiGLU, GeGLU-tanh) and the residual add. */
#include "cuda_common.h"
#include "q8_dev.h"

__global__ void glu_kernel(int act, const float *__restrict__ gate, const float *__restrict__ up, int64_t in_stride,
                           float *__restrict__ out, int64_t out_stride, int n, gq_blk *__restrict__ xq,
                           uint16_t *__restrict__ o16)
{
    m40k_pdl_begin(); /* PDL-launched; a PDL-launched kernel may follow */
    M40K_LAUNDER(gate);
    M40K_LAUNDER(up);
    M40K_LAUNDER(out);
    M40K_LAUNDER(xq);
    M40K_LAUNDER(o16);
    const int r = blockIdx.y;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float o = m40k_glu_one(act, gate[r * in_stride + i], up[r * in_stride + i]);
        if (out)
            out[r * out_stride + i] = o;
        if (xq) /* n % 32 == 0: a warp holds one whole block */
            gq_quantize_block(o, threadIdx.x & 31, xq + (size_t)r * (n / 32) + i / 32);
        if (o16)
            o16[(size_t)r * n + i] = m40k_f2h(o);
    }
}

/* The F16 copy (and out, unless NULL) four elements a thread: 16-byte loads of gate and
 * up, an 8-byte store of the F16 copy. Prefill's chunks read 58 MB of F32 gate/up a
 * layer here (Mistral's shape, 512 rows); one element a thread, and out written when
 * only the F16 copy is read, took 6% of a Q4_K_M chunk (BENCHMARKS.md). Same values as
 * glu_kernel. */
__global__ void glu4_kernel(int act, const float *__restrict__ gate, const float *__restrict__ up, int64_t in_stride,
                            float *__restrict__ out, int64_t out_stride, int n4, uint16_t *__restrict__ o16)
{
    m40k_pdl_begin();
    M40K_LAUNDER(gate);
    M40K_LAUNDER(up);
    M40K_LAUNDER(out);
    M40K_LAUNDER(o16);
    const int r = blockIdx.y;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += gridDim.x * blockDim.x) {
        const float4 g = *reinterpret_cast<const float4 *>(gate + r * in_stride + 4 * i);
        const float4 u = *reinterpret_cast<const float4 *>(up + r * in_stride + 4 * i);
        const float4 o = make_float4(m40k_glu_one(act, g.x, u.x), m40k_glu_one(act, g.y, u.y),
                                     m40k_glu_one(act, g.z, u.z), m40k_glu_one(act, g.w, u.w));
        if (out)
            *reinterpret_cast<float4 *>(out + r * out_stride + 4 * i) = o;
        if (o16)
            *reinterpret_cast<uint2 *>(o16 + (size_t)r * 4 * n4 + 4 * i) =
                m40k_pack_h4(o);
    }
}

/* The GLU of F16 gate/up (a product written in F16 at a scale, m40k_glu_h16): V
 * elements a thread, in one load of each input (V 8: 16 bytes, where the rows allow it;
 * 4: 8 bytes; 1). A prompt chunk's GLU streams tens of MB: 16-byte loads keep twice the
 * bytes in flight a thread that 8-byte ones did (BENCHMARKS.md, thirty-first session). */
template <int V> struct glu_vec;
template <> struct glu_vec<8> { typedef uint4 t; };
template <> struct glu_vec<4> { typedef uint2 t; };
template <> struct glu_vec<1> { typedef uint16_t t; };

template <int V>
__global__ void glu_h_kernel(int act, const uint16_t *__restrict__ gate, const uint16_t *__restrict__ up,
                             int64_t in_stride, float scale, int n, uint16_t *__restrict__ o16)
{
    m40k_pdl_begin();
    M40K_LAUNDER(gate);
    M40K_LAUNDER(up);
    M40K_LAUNDER(o16);
    typedef typename glu_vec<V>::t vec;
    const int r = blockIdx.y;
    const int m = n / V;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < m; i += gridDim.x * blockDim.x) {
        const vec g = *reinterpret_cast<const vec *>(gate + r * in_stride + V * i);
        const vec u = *reinterpret_cast<const vec *>(up + r * in_stride + V * i);
        if constexpr (V == 1) {
            o16[(size_t)r * n + i] = m40k_f2h(m40k_glu_one(act, scale * m40k_h2f(g), scale * m40k_h2f(u)));
        } else {
            const uint32_t *gw = reinterpret_cast<const uint32_t *>(&g), *uw = reinterpret_cast<const uint32_t *>(&u);
            vec o;
            uint32_t *ow = reinterpret_cast<uint32_t *>(&o);
#pragma unroll
            for (int k = 0; k < V / 2; k++) {
                const float o0 =
                    m40k_glu_one(act, scale * m40k_h2f((uint16_t)gw[k]), scale * m40k_h2f((uint16_t)uw[k]));
                const float o1 = m40k_glu_one(act, scale * m40k_h2f((uint16_t)(gw[k] >> 16)),
                                              scale * m40k_h2f((uint16_t)(uw[k] >> 16)));
                ow[k] = m40k_pack_h2(o0, o1);
            }
            *reinterpret_cast<vec *>(o16 + (size_t)r * n + V * i) = o;
        }
    }
}

__global__ void add_kernel(float *out, const float *a, const float *b, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = a[i] + b[i];
}

/* xq: also the int8 quantization of out (n a multiple of 32); o16: also its F16 copy */
static int glu_launch(int act, const float *gate, const float *up, int64_t in_stride, float *out, int64_t out_stride,
                      int rows, int n, gq_blk *xq, uint16_t *o16, m40k_stream stream)
{
    if (rows <= 0 || n <= 0)
        return 0;
    if ((act != M40K_GLU_SILU && act != M40K_GLU_GELU_TANH) || rows > 65535 || (xq && n % 32) || (!out && !xq && !o16))
        return M40K_INVALID;
    if (!xq && n % 4 == 0 && in_stride % 4 == 0 && (!out || out_stride % 4 == 0) && ((uintptr_t)gate & 15) == 0 &&
        ((uintptr_t)up & 15) == 0 && ((uintptr_t)out & 15) == 0 && ((uintptr_t)o16 & 7) == 0) {
        dim3 grid4((unsigned)min((n / 4 + 255) / 256, 1024), (unsigned)rows);
        M40K_LAUNCH_PDL(glu4_kernel, grid4, 256, 0, stream, act, gate, up, in_stride, out, out_stride, n / 4, o16);
        return m40k_launch_status();
    }
    dim3 grid((unsigned)min((n + 255) / 256, 1024), (unsigned)rows);
    M40K_LAUNCH_PDL(glu_kernel, grid, 256, 0, stream, act, gate, up, in_stride, out, out_stride, n, xq, o16);
    return m40k_launch_status();
}

extern "C" int m40k_glu(int act, const float *gate, const float *up, int64_t in_stride, float *out,
                        int64_t out_stride, int rows, int n, m40k_stream stream)
{
    return glu_launch(act, gate, up, in_stride, out, out_stride, rows, n, nullptr, nullptr, stream);
}

extern "C" int m40k_glu_q8(int act, const float *gate, const float *up, int64_t in_stride, float *out,
                           int64_t out_stride, int rows, int n, void *xq, m40k_stream stream)
{
    if (!xq && rows > 0 && n > 0)
        return M40K_INVALID;
    return glu_launch(act, gate, up, in_stride, out, out_stride, rows, n, (gq_blk *)xq, nullptr, stream);
}

extern "C" int m40k_glu_f16(int act, const float *gate, const float *up, int64_t in_stride, float *out,
                            int64_t out_stride, int rows, int n, uint16_t *out16, m40k_stream stream)
{
    if (!out16 && rows > 0 && n > 0)
        return M40K_INVALID;
    return glu_launch(act, gate, up, in_stride, out, out_stride, rows, n, nullptr, out16, stream);
}

extern "C" int m40k_glu_h16(int act, const uint16_t *gate, const uint16_t *up, int64_t in_stride, float in_scale,
                            uint16_t *out16, int rows, int n, m40k_stream stream)
{
    if (rows <= 0 || n <= 0)
        return 0;
    if ((act != M40K_GLU_SILU && act != M40K_GLU_GELU_TANH) || rows > 65535 || !gate || !up || !out16 ||
        in_stride < n)
        return M40K_INVALID;
    /* the widest loads the rows' width, stride and alignment allow */
    const uintptr_t al = (uintptr_t)gate | (uintptr_t)up | (uintptr_t)out16;
    const int v = n % 8 == 0 && in_stride % 8 == 0 && (al & 15) == 0  ? 8
                  : n % 4 == 0 && in_stride % 4 == 0 && (al & 7) == 0 ? 4
                                                                      : 1;
    dim3 grid((unsigned)min((n / v + 255) / 256, 1024), (unsigned)rows);
    if (v == 8)
        M40K_LAUNCH_PDL(glu_h_kernel<8>, grid, 256, 0, stream, act, gate, up, in_stride, in_scale, n, out16);
    else if (v == 4)
        M40K_LAUNCH_PDL(glu_h_kernel<4>, grid, 256, 0, stream, act, gate, up, in_stride, in_scale, n, out16);
    else
        M40K_LAUNCH_PDL(glu_h_kernel<1>, grid, 256, 0, stream, act, gate, up, in_stride, in_scale, n, out16);
    return m40k_launch_status();
}

extern "C" int m40k_add(float *out, const float *a, const float *b, int64_t n, m40k_stream stream)
{
    if (n <= 0)
        return 0;
    const int64_t blocks = (n + 255) / 256;
    add_kernel<<<(unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, stream>>>(out, a, b, n);
    return m40k_launch_status();
}
