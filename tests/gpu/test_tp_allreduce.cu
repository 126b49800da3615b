/* Tensor parallelism's all-reduce on NCCL's device API (kernels.h 11, m40k_tp_allreduce)
 * against its CPU twin (m40_ref_tp_allreduce), bit for bit: on 2 GPUs and, where the host
 * has them, 4; counts of 1, 3, 4, 257, 1,023, 8,192, 65,537 and 262,144 floats (one block
 * to the 32-block cap, the float4 body and the scalar tail), inputs at window offsets 0,
 * 16 and 4 bytes (the scalar path), every rank's output checked against the twin's sum
 * and against rank 0's (the ranks must agree exactly); then 200 calls in a row that
 * alternate two windows as the engine does, on fresh inputs each time (a rank that ran
 * ahead and overwrote its input before a peer read it shows as a wrong sum); the abort
 * of calls waiting for a rank that never comes (the flag the engine sets when a rank
 * fails inside a step); and one timing line with --bench.
 * NCCL is opened at run time (libnccl.so.2, as engine/gpu/tp.c does). Skips with fewer
 * than 2 GPUs, without NCCL, or without its device headers at build time. */
#include <algorithm>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <vector>

#include "kernels.h"
#include "ref/cpu_ref.h"

#define GPU_CHECK_SEED 0xA24BAED4963EE407ull
#include "gpu_check.h"

#if defined(__has_include)
#if __has_include(<nccl.h>)
#include <nccl.h>
#define HAVE_NCCL_H 1
#endif
#endif

#ifdef HAVE_NCCL_H
static struct {
    ncclResult_t (*init_all)(ncclComm_t *, int, const int *);
    ncclResult_t (*destroy)(ncclComm_t);
    ncclResult_t (*mem_alloc)(void **, size_t);
    ncclResult_t (*mem_free)(void *);
    ncclResult_t (*win_register)(ncclComm_t, void *, size_t, ncclWindow_t *, int);
    ncclResult_t (*win_deregister)(ncclComm_t, ncclWindow_t);
    ncclResult_t (*dev_create)(ncclComm_t, const void *, void *);
    ncclResult_t (*dev_destroy)(ncclComm_t, const void *);
    ncclResult_t (*group_start)(void);
    ncclResult_t (*group_end)(void);
} nc;

static bool nccl_open(void)
{
    void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h)
        return false;
    *(void **)&nc.init_all = dlsym(h, "ncclCommInitAll");
    *(void **)&nc.destroy = dlsym(h, "ncclCommDestroy");
    *(void **)&nc.mem_alloc = dlsym(h, "ncclMemAlloc");
    *(void **)&nc.mem_free = dlsym(h, "ncclMemFree");
    *(void **)&nc.win_register = dlsym(h, "ncclCommWindowRegister");
    *(void **)&nc.win_deregister = dlsym(h, "ncclCommWindowDeregister");
    *(void **)&nc.dev_create = dlsym(h, "ncclDevCommCreate");
    *(void **)&nc.dev_destroy = dlsym(h, "ncclDevCommDestroy");
    *(void **)&nc.group_start = dlsym(h, "ncclGroupStart");
    *(void **)&nc.group_end = dlsym(h, "ncclGroupEnd");
    return nc.init_all && nc.destroy && nc.mem_alloc && nc.mem_free && nc.win_register && nc.win_deregister &&
           nc.dev_create && nc.dev_destroy && nc.group_start && nc.group_end;
}

#define NC(call)                                                                                                       \
    do {                                                                                                               \
        ncclResult_t r_ = (call);                                                                                      \
        if (r_ != ncclSuccess) {                                                                                       \
            fprintf(stderr, "%s:%d: %s: NCCL error %d\n", __FILE__, __LINE__, #call, (int)r_);                         \
            exit(2);                                                                                                   \
        }                                                                                                              \
    } while (0)

struct group {
    int n;
    ncclComm_t comm[4];
    float *buf[4][2], *out[4];
    ncclWindow_t win[4][2];
    std::vector<char> dev[4];
    cudaStream_t st[4];
    size_t bytes;
};

static void group_open(group &g, int n, size_t floats)
{
    g.n = n;
    int devs[4] = {0, 1, 2, 3};
    NC(nc.init_all(g.comm, n, devs));
    g.bytes = (floats * 4 + 16 + ((size_t)2 << 20) - 1) / ((size_t)2 << 20) * ((size_t)2 << 20);
    for (int r = 0; r < n; r++) {
        CK(cudaSetDevice(r));
        CK(cudaStreamCreateWithFlags(&g.st[r], cudaStreamNonBlocking));
        for (int b = 0; b < 2; b++)
            NC(nc.mem_alloc((void **)&g.buf[r][b], g.bytes));
        CK(cudaMalloc(&g.out[r], floats * 4 + 16));
        g.dev[r].assign(m40k_tp_devcomm_bytes(), 0);
    }
    NC(nc.group_start());
    for (int r = 0; r < n; r++) {
        CK(cudaSetDevice(r));
        for (int b = 0; b < 2; b++)
            NC(nc.win_register(g.comm[r], g.buf[r][b], g.bytes, &g.win[r][b], NCCL_WIN_COLL_SYMMETRIC));
    }
    NC(nc.group_end());
    alignas(16) char q[512]; /* an ncclDevCommRequirements */
    if (!m40k_tp_devcomm_reqs(q, sizeof q)) {
        fprintf(stderr, "m40k_tp_devcomm_reqs: more than %zu bytes\n", sizeof q);
        exit(2);
    }
    NC(nc.group_start());
    for (int r = 0; r < n; r++) {
        CK(cudaSetDevice(r));
        NC(nc.dev_create(g.comm[r], q, g.dev[r].data()));
    }
    NC(nc.group_end());
}

static void group_close(group &g)
{
    NC(nc.group_start());
    for (int r = 0; r < g.n; r++) {
        CK(cudaSetDevice(r));
        nc.dev_destroy(g.comm[r], g.dev[r].data());
        for (int b = 0; b < 2; b++)
            nc.win_deregister(g.comm[r], g.win[r][b]);
    }
    NC(nc.group_end());
    for (int r = 0; r < g.n; r++) {
        CK(cudaSetDevice(r));
        for (int b = 0; b < 2; b++)
            nc.mem_free(g.buf[r][b]);
        cudaFree(g.out[r]);
        cudaStreamDestroy(g.st[r]);
        nc.destroy(g.comm[r]);
    }
}

/* One call on every rank: inputs in window b at byte offset off, outputs to out (or, with
 * to_win, to the other window at the same offset); returns each rank's output. */
static std::vector<std::vector<float>> call(group &g, int b, size_t off, int64_t count,
                                            const std::vector<std::vector<float>> &in, bool to_win)
{
    for (int r = 0; r < g.n; r++) {
        CK(cudaSetDevice(r));
        CK(cudaMemcpyAsync((char *)g.buf[r][b] + off, in[r].data(), (size_t)count * 4, cudaMemcpyHostToDevice,
                           g.st[r]));
    }
    for (int r = 0; r < g.n; r++) {
        CK(cudaSetDevice(r));
        float *o = to_win ? (float *)((char *)g.buf[r][1 - b] + off) : g.out[r];
        CK(m40k_tp_allreduce(g.dev[r].data(), g.win[r][b], off, o, count, nullptr, (m40k_stream)g.st[r]));
    }
    std::vector<std::vector<float>> res(g.n, std::vector<float>((size_t)count));
    for (int r = 0; r < g.n; r++) {
        CK(cudaSetDevice(r));
        const float *o = to_win ? (const float *)((const char *)g.buf[r][1 - b] + off) : g.out[r];
        CK(cudaMemcpyAsync(res[r].data(), o, (size_t)count * 4, cudaMemcpyDeviceToHost, g.st[r]));
        CK(cudaStreamSynchronize(g.st[r]));
    }
    return res;
}

static void check(const char *what, const std::vector<std::vector<float>> &in,
                  const std::vector<std::vector<float>> &got)
{
    const int n = (int)in.size();
    const int64_t count = (int64_t)in[0].size();
    std::vector<const float *> p(n);
    for (int r = 0; r < n; r++)
        p[r] = in[r].data();
    std::vector<float> want((size_t)count);
    m40_ref_tp_allreduce(p.data(), n, want.data(), count);
    for (int r = 0; r < n; r++) {
        if (memcmp(got[r].data(), want.data(), (size_t)count * 4) != 0) {
            int64_t i = 0;
            while (got[r][i] == want[i])
                i++;
            n_fail++;
            printf("FAIL %s: rank %d of %d, count %lld: [%lld] gpu %g cpu %g\n", what, r, n, (long long)count,
                   (long long)i, got[r][i], want[i]);
            return;
        }
    }
    n_pass++;
}

/* The last rank never calls: the others wait at the barrier until the abort flag (mapped
 * host memory) is set, then end without their sums, within a second. Last on a group: its
 * barriers' epochs no longer agree afterwards. */
static void abort_case(group &g)
{
    int *flag = nullptr, *dflag = nullptr;
    CK(cudaHostAlloc((void **)&flag, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
    *(volatile int *)flag = 0;
    CK(cudaHostGetDevicePointer((void **)&dflag, flag, 0));
    for (int r = 0; r + 1 < g.n; r++) {
        CK(cudaSetDevice(r));
        CK(m40k_tp_allreduce(g.dev[r].data(), g.win[r][0], 0, g.out[r], 4096, dflag, (m40k_stream)g.st[r]));
    }
    usleep(50 * 1000);
    bool waiting = true;
    for (int r = 0; r + 1 < g.n; r++) {
        CK(cudaSetDevice(r));
        waiting = waiting && cudaStreamQuery(g.st[r]) == cudaErrorNotReady;
    }
    *(volatile int *)flag = 1;
    __sync_synchronize();
    bool ended = false;
    for (int ms = 0; ms < 5000 && !ended; ms += 10) {
        ended = true;
        for (int r = 0; r + 1 < g.n; r++) {
            CK(cudaSetDevice(r));
            ended = ended && cudaStreamQuery(g.st[r]) == cudaSuccess;
        }
        if (!ended)
            usleep(10 * 1000);
    }
    if (waiting && ended) {
        n_pass++;
    } else {
        n_fail++;
        printf("FAIL tp_allreduce n=%d abort: %s\n", g.n,
               !waiting ? "the calls did not wait for the missing rank" : "still waiting 5 s after the abort");
        if (!ended)
            exit(1); /* kernels that never end: only the process's end stops them */
    }
    cudaFreeHost(flag);
}

static void run(int n, bool bench)
{
    const int64_t counts[] = {1, 3, 4, 257, 1023, 8192, 65537, 262144};
    const size_t offs[] = {0, 16, 4};
    group g;
    group_open(g, n, 262144 + 16);
    for (int64_t count : counts)
        for (size_t off : offs) {
            std::vector<std::vector<float>> in(n);
            for (int r = 0; r < n; r++)
                in[r] = rand_vec((size_t)count, -4.0f, 4.0f);
            char what[96];
            snprintf(what, sizeof what, "tp_allreduce n=%d off=%zu", n, off);
            check(what, in, call(g, (int)(count & 1), off, count, in, false));
        }
    /* the engine's pattern: window b to window 1-b, then b = 1-b, 200 times, inputs
     * rewritten by the host between calls (stream-ordered after the previous call) */
    int b = 0, bad = 0;
    for (int it = 0; it < 200 && !bad; it++) {
        const int64_t count = it % 3 == 0 ? 8192 : it % 3 == 1 ? 57344 : 4096 * 3;
        std::vector<std::vector<float>> in(n);
        for (int r = 0; r < n; r++)
            in[r] = rand_vec((size_t)count);
        const int f0 = n_fail;
        char what[96];
        snprintf(what, sizeof what, "tp_allreduce n=%d alternating, call %d", n, it);
        check(what, in, call(g, b, 0, count, in, true));
        bad = n_fail != f0;
        if (!bad)
            n_pass--; /* one pass for the whole run below */
        b = 1 - b;
    }
    if (!bad)
        n_pass++;
    if (bench) {
        /* each rank's calls as one CUDA graph of 200 (the engine's steps are graphs too),
         * all ranks' graphs launched, then timed on rank 0: the kernel's own latency, not
         * one host thread's launches to n GPUs in turn */
        for (int64_t count : {8192L, 32768L, 262144L}) {
            const int iters = 200;
            cudaGraphExec_t ex[4];
            for (int r = 0; r < n; r++) {
                CK(cudaSetDevice(r));
                CK(cudaStreamSynchronize(g.st[r]));
                cudaGraph_t gr;
                CK(cudaStreamBeginCapture(g.st[r], cudaStreamCaptureModeThreadLocal));
                for (int it = 0; it < iters; it++)
                    CK(m40k_tp_allreduce(g.dev[r].data(), g.win[r][it & 1], 0, (float *)g.buf[r][1 - (it & 1)], count,
                                         nullptr, (m40k_stream)g.st[r]));
                CK(cudaStreamEndCapture(g.st[r], &gr));
                CK(cudaGraphInstantiate(&ex[r], gr, 0));
                CK(cudaGraphDestroy(gr));
            }
            cudaEvent_t e0, e1;
            CK(cudaSetDevice(0));
            CK(cudaEventCreate(&e0));
            CK(cudaEventCreate(&e1));
            float best = 1e30f;
            for (int rep = 0; rep < 3; rep++) { /* the first warms up */
                CK(cudaSetDevice(0));
                CK(cudaEventRecord(e0, g.st[0]));
                for (int r = 0; r < n; r++) {
                    CK(cudaSetDevice(r));
                    CK(cudaGraphLaunch(ex[r], g.st[r]));
                }
                CK(cudaSetDevice(0));
                CK(cudaEventRecord(e1, g.st[0]));
                for (int r = 0; r < n; r++) {
                    CK(cudaSetDevice(r));
                    CK(cudaStreamSynchronize(g.st[r]));
                }
                float ms = 0;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                if (rep > 0)
                    best = std::min(best, ms);
            }
            printf("bench tp_allreduce n=%d count %lld (%lld KB): %.2f us a call (CUDA graphs of %d calls)\n", n,
                   (long long)count, (long long)count * 4 / 1024, best * 1000.0 / iters, iters);
            cudaEventDestroy(e0), cudaEventDestroy(e1);
            for (int r = 0; r < n; r++) {
                CK(cudaSetDevice(r));
                CK(cudaGraphExecDestroy(ex[r]));
            }
        }
    }
    abort_case(g);
    group_close(g);
}
#endif

int main(int argc, char **argv)
{
    bool bench = argc > 1 && !strcmp(argv[1], "--bench");
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev < 2) {
        printf("SKIP: tensor parallelism's all-reduce needs 2 GPUs, this host has %d\n", ndev);
        printf("0 passed, 0 failed, 1 skipped\n");
        return 0;
    }
#ifdef HAVE_NCCL_H
    if (!m40k_tp_devcomm_bytes()) {
        printf("SKIP: kernels built without NCCL's device headers\n0 passed, 0 failed, 1 skipped\n");
        return 0;
    }
    if (!nccl_open()) {
        printf("SKIP: libnccl.so.2 (2.28 or later) not found\n0 passed, 0 failed, 1 skipped\n");
        return 0;
    }
    run(2, bench);
    if (ndev >= 4)
        run(4, bench);
    printf("%d passed, %d failed, %d skipped\n", n_pass, n_fail, n_skip);
    return n_fail ? 1 : 0;
#else
    printf("SKIP: no nccl.h at build time\n0 passed, 0 failed, 1 skipped\n");
    return 0;
#endif
}
