/* Tensor parallelism's all-reduce of a small product (kernels.h 11), on NCCL's device API:
 * every rank's partial sum sits in a symmetric window (ncclCommWindowRegister), every
 * rank's block b meets the other ranks' block b at an LSA barrier, then reads the slice it
 * owns from each rank's window over NVLink (ncclGetLsaPointer) and writes the sum into its
 * own output. One barrier and one pass over n x count floats of loads: the latency of a
 * 16-64 KB all-reduce is about that of the barrier (NCCL's own all-reduces and its
 * symmetric kernels: BENCHMARKS.md, sessions 19 and 32).
 *
 * Why one barrier is enough: a rank arrives only once the kernels before it on its stream
 * wrote its input, so after the wait every input is complete; nobody writes a peer's
 * memory; and a rank overwrites its input only after a later call's barrier, which no
 * rank passes before every rank has finished reading this call's inputs (the engine
 * alternates two windows: engine/gpu/tp.c). The ranks add in rank order 0..n-1, so every
 * rank holds bit-identical sums (the CPU twin, m40_ref_tp_allreduce, adds the same way). */
#include "cuda_common.h"

#if defined(__has_include)
#if __has_include(<nccl_device.h>)
#include <nccl_device.h>
#define M40K_HAVE_NCCL_DEVICE 1
#endif
#endif

#ifdef M40K_HAVE_NCCL_DEVICE

static __device__ __forceinline__ float4 add4(float4 a, float4 b)
{
    return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

/* ncclLsaBarrierSession::wait (unicast, NCCL 2.28's nccl_device/impl/lsa_barrier__funcs.h:
 * each peer's inbox slot reaches this session's epoch + 1), and every 64 polls (tens of
 * microseconds; a step's barrier takes a few) a look at *abort, which the host sets when
 * it aborts the group (engine/gpu/tp.c, group_abort): NCCL's own kernels end on
 * ncclCommAbort, a spin on its barrier would not, and the GPUs whose peer failed inside a
 * step would wait for ever. false: aborted (the block returns without its sums; the group
 * takes no more work). */
static __device__ bool tp_wait(ncclLsaBarrierSession<ncclCoopCta> &bar, const volatile int *abort)
{
    bool ok = true;
    for (int i = threadIdx.x; i < bar.team.nRanks - 1 && ok; i += blockDim.x) {
        const int peer = i + (bar.team.rank <= i ? 1 : 0);
        cuda::atomic_ref<uint32_t> inbox(*bar.ucInbox(bar.team.rank, peer));
        for (unsigned spin = 1;; spin++) {
            const uint32_t got = inbox.load(cuda::memory_order_acquire);
            if (got - (bar.epoch + 1) <= uint32_t(-1) >> 1)
                break;
            if ((spin & 63) == 0 && abort && *abort) {
                ok = false;
                break;
            }
        }
    }
    bar.epoch += 1;
    return __syncthreads_and(ok) != 0;
}

__global__ void __launch_bounds__(256)
    tp_allreduce_kernel(ncclDevComm comm, ncclWindow_t win, size_t in_off, float *__restrict__ out, int64_t count,
                        const volatile int *abort)
{
    ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), comm, ncclTeamTagLsa(), blockIdx.x);
    /* arrive relaxed (the inputs were written by earlier kernels, complete in each
     * owner's memory), wait with acquire before the peers' loads */
    bar.arrive(ncclCoopCta(), cuda::memory_order_relaxed);
    if (!tp_wait(bar, abort)) /* the group was aborted: a peer will never arrive */
        return;
    const int nr = comm.lsaSize;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x, t0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    /* float4 where the window offset and out allow it, then the rest (all of it otherwise) */
    const int64_t n4 = (in_off & 15) == 0 && ((uintptr_t)out & 15) == 0 ? count >> 2 : 0;
    for (int64_t i = t0; i < n4; i += stride) {
        float4 s = __ldcg((const float4 *)ncclGetLsaPointer(win, in_off, 0) + i);
        for (int r = 1; r < nr; r++)
            s = add4(s, __ldcg((const float4 *)ncclGetLsaPointer(win, in_off, r) + i));
        reinterpret_cast<float4 *>(out)[i] = s;
    }
    for (int64_t i = (n4 << 2) + t0; i < count; i += stride) {
        float s = __ldcg((const float *)ncclGetLsaPointer(win, in_off, 0) + i);
        for (int r = 1; r < nr; r++)
            s += __ldcg((const float *)ncclGetLsaPointer(win, in_off, r) + i);
        out[i] = s;
    }
}

extern "C" size_t m40k_tp_devcomm_bytes(void)
{
    return sizeof(ncclDevComm);
}

extern "C" int m40k_tp_nccl_version(void)
{
    return NCCL_VERSION_CODE;
}

extern "C" size_t m40k_tp_devcomm_reqs(void *reqs, size_t cap)
{
    if (!reqs || cap < sizeof(ncclDevCommRequirements))
        return 0;
    ncclDevCommRequirements q;
    memset(&q, 0, sizeof q);
    q.lsaBarrierCount = M40K_TP_AR_BLOCKS;
    memcpy(reqs, &q, sizeof q);
    return sizeof q;
}

extern "C" int m40k_tp_allreduce(const void *dev_comm, void *win, size_t in_off, float *out, int64_t count,
                                 const int *abort, m40k_stream stream)
{
    if (!dev_comm || !win || !out || count < 0)
        return M40K_INVALID;
    if (count == 0)
        return 0;
    /* a block a 1,024 floats (256 threads of float4), at most M40K_TP_AR_BLOCKS: the
     * barrier's cost grows with the blocks, the loads in flight with them */
    int64_t blocks = (count + 1023) / 1024;
    if (blocks > M40K_TP_AR_BLOCKS)
        blocks = M40K_TP_AR_BLOCKS;
    ncclDevComm c;
    memcpy(&c, dev_comm, sizeof c);
    tp_allreduce_kernel<<<(unsigned)blocks, 256, 0, (cudaStream_t)stream>>>(c, (ncclWindow_t)win, in_off, out, count,
                                                                            abort);
    return m40k_launch_status();
}

#else

extern "C" size_t m40k_tp_devcomm_bytes(void)
{
    return 0;
}

extern "C" int m40k_tp_nccl_version(void)
{
    return 0;
}

extern "C" size_t m40k_tp_devcomm_reqs(void *reqs, size_t cap)
{
    (void)reqs, (void)cap;
    return 0;
}

extern "C" int m40k_tp_allreduce(const void *dev_comm, void *win, size_t in_off, float *out, int64_t count,
                                 const int *abort, m40k_stream stream)
{
    (void)dev_comm, (void)win, (void)in_off, (void)out, (void)count, (void)abort, (void)stream;
    return (int)cudaErrorNotSupported;
}

#endif
