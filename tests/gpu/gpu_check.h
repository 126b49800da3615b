/* Shared by the GPU kernel tests (tests/gpu/test_*.cu): pass/fail counters, a CUDA
 * error check that aborts, a seeded xorshift generator, device copies of host vectors
 * and the tolerance comparison of GPU output against the CPU twin's.
 * Define GPU_CHECK_SEED (a 64-bit nonzero constant) before including: each test keeps
 * its own random inputs. */
#ifndef M40_GPU_CHECK_H
#define M40_GPU_CHECK_H

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <algorithm>
#include <vector>

#ifndef GPU_CHECK_SEED
#error "define GPU_CHECK_SEED before including gpu_check.h"
#endif

static int n_pass, n_fail, n_skip;

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (cudaError_t)(call);                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)

/* Mean microseconds of one run() over iters calls on the default stream, after 3
 * untimed calls (CUDA events). */
template <class F> static double time_us(F run, int iters)
{
    for (int i = 0; i < 3; i++)
        run();
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaEventRecord(e0));
    for (int i = 0; i < iters; i++)
        run();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    return ms * 1000.0 / iters;
}

static uint64_t rng = GPU_CHECK_SEED;
static inline uint32_t rnd32(void)
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}
static inline float frand(float lo, float hi) { return lo + (hi - lo) * (rnd32() & 0xFFFFFF) / 16777216.0f; }
static inline std::vector<float> rand_vec(size_t n, float lo = -1.0f, float hi = 1.0f)
{
    std::vector<float> v(n);
    for (auto &x : v)
        x = frand(lo, hi);
    return v;
}

/* A device copy of h, with 64 bytes of slack past the end (kernels that may read a
 * little past their data stay inside the allocation). */
template <class T> static T *dup(const std::vector<T> &h)
{
    T *d;
    CK(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T) + 64));
    if (!h.empty())
        CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}
/* n elements of d back on the host, after the device finished its work. */
template <class T> static std::vector<T> back(const T *d, size_t n)
{
    std::vector<T> h(n);
    CK(cudaDeviceSynchronize());
    if (n)
        CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}

/* |g - c| <= atol + rtol*|c| everywhere; one pass/fail per call, first miss printed */
static inline void compare(const char *what, const float *g, const float *c, size_t n, float atol, float rtol)
{
    size_t bad = 0, first = 0;
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)g[i] - c[i]);
        if (!(d <= atol + rtol * fabs(c[i])) && !bad++)
            first = i;
        worst = std::max(worst, d);
    }
    if (bad) {
        n_fail++;
        printf("FAIL %s: %zu/%zu differ, first [%zu] gpu %g cpu %g (max abs diff %g)\n", what, bad, n, first,
               g[first], c[first], worst);
    } else {
        n_pass++;
    }
}

#ifdef M40_KERNELS_H
/* m40k_attn_decode_rope's options with only the int8 records and the sinks set (valid
 * until the next call: pass it straight to the kernel call) */
static inline const m40k_dec_opts *dec_opts_q8(void *out_q8, const float *sinks = nullptr)
{
    static m40k_dec_opts o;
    o = m40k_dec_opts{};
    o.out_q8 = out_q8, o.sinks = sinks;
    return &o;
}

/* The device layouts of kernels.h 0. in the tests: the GGUF type whose bytes a layout
 * rewrites (the twins read that type), the suffix a test name gives it, and a matrix of
 * rows x K of the base type rewritten into it (kernels.h must be included before). */
static inline int dev_base(int type)
{
    return type == M40K_TYPE_Q8_0_G8                                ? M40K_TYPE_Q8_0
           : type == M40K_TYPE_Q6_K_G8 || type == M40K_TYPE_Q6_K_P ? M40K_TYPE_Q6_K
           : type == M40K_TYPE_MXFP4_P                             ? M40K_TYPE_MXFP4
                                                                    : type;
}
static inline const char *dev_suffix(int type)
{
    return type == M40K_TYPE_Q8_0_G8 || type == M40K_TYPE_Q6_K_G8                ? "_G8"
           : type == M40K_TYPE_Q6_K_P || type == M40K_TYPE_MXFP4_P ? "_P"
                                                                      : "";
}
static inline std::vector<uint8_t> dev_layout(int type, const std::vector<uint8_t> &w, int64_t rows, int64_t K)
{
    if (type == M40K_TYPE_Q6_K_P || type == M40K_TYPE_MXFP4_P) {
        std::vector<uint8_t> p((size_t)rows * (size_t)m40k_padded_row_bytes(type, K));
        CK((type == M40K_TYPE_Q6_K_P ? m40k_repack_q6_k_p(w.data(), p.data(), rows, K)
                                      : m40k_repack_mxfp4_p(w.data(), p.data(), rows, K)) == 0
               ? cudaSuccess
               : cudaErrorInvalidValue);
        return p;
    }
    std::vector<uint8_t> d = w;
    if (type != dev_base(type))
        CK(m40k_repack_g8(dev_base(type), w.data(), d.data(), rows, K) == 0 ? cudaSuccess : cudaErrorInvalidValue);
    return d;
}
#endif

#endif
