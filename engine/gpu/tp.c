/* Tensor parallelism on GPUs: loading a split model (m40_gpu_load_tp: each rank's shard
 * on its GPU), and its group: NCCL communicators over the GPUs and a pool of as many
 * host threads as ranks, the engine thread one of them (util/threadpool.h: with no more
 * tasks than threads, a task that waits for the others keeps its thread while the others
 * are claimed by free ones). The forward pass's part (the collectives' places, the step
 * over the ranks) is in model_cuda_fwd.c.
 *
 * Why a thread per rank: each rank's forward pass is the single-GPU one (the same
 * kernels, the same CUDA graphs) on its shard, with NCCL's all-reduce and all-gather
 * enqueued on its stream where the ranks meet. An NCCL call may block until every rank
 * has made its own, so one thread issuing the calls of several ranks in turn would need
 * them grouped (ncclGroupStart/End) inside the forward pass. Here a rank whose call
 * blocks holds its thread, and the ranks not started yet go to the pool's free threads;
 * a thread runs a second rank only after the first finished without waiting. So rank r
 * runs exactly what a single GPU runs, and its graphs capture its NCCL calls.
 *
 * NCCL is opened at run time (dlopen of libnccl.so.2) when a model asks for tp > 1, so a
 * single-GPU build or machine needs no NCCL at all; the error says where it looked.
 * NVLink multicast (NVLS) is off unless the environment turns it on (NCCL_NVLS_ENABLE,
 * set to 0 here when absent; nginx passes NCCL_* to its workers only through env
 * directives): m40 never measured it, and the lent hosts keep it off. */
#ifdef M40_HAVE_CUDA

#include "model_cuda_int.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "model/tp_shard.h"
#include "util/threadpool.h"

#if defined(__has_include)
#if __has_include(<nccl.h>)
#include <nccl.h>
#define M40_HAVE_NCCL_H 1
#endif
#endif

#ifdef M40_HAVE_NCCL_H

typedef struct {
    void *h;
    ncclResult_t (*comm_init_all)(ncclComm_t *, int, const int *);
    ncclResult_t (*comm_destroy)(ncclComm_t);
    ncclResult_t (*all_reduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
    ncclResult_t (*all_gather)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
    const char *(*error_string)(ncclResult_t);
    ncclResult_t (*get_version)(int *);
    ncclResult_t (*comm_abort)(ncclComm_t);
    /* symmetric windows (NCCL 2.27 on; all NULL where the library lacks them) */
    ncclResult_t (*mem_alloc)(void **, size_t);
    ncclResult_t (*mem_free)(void *);
    ncclResult_t (*win_register)(ncclComm_t, void *, size_t, ncclWindow_t *, int);
    ncclResult_t (*win_deregister)(ncclComm_t, ncclWindow_t);
    ncclResult_t (*group_start)(void);
    ncclResult_t (*group_end)(void);
    /* the device API (NCCL 2.28 on): m40k_tp_allreduce's communicator */
    ncclResult_t (*dev_create)(ncclComm_t, const void *, void *);
    ncclResult_t (*dev_destroy)(ncclComm_t, const void *);
} nccl_api;

static nccl_api nccl;
static pthread_once_t nccl_once = PTHREAD_ONCE_INIT;
static char nccl_err[256];

static void nccl_open(void)
{
    const char *names[] = {"libnccl.so.2", "libnccl.so"};
    for (size_t i = 0; i < 2 && !nccl.h; i++)
        nccl.h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!nccl.h) {
        snprintf(nccl_err, sizeof nccl_err,
                 "tensor parallelism needs NCCL, and libnccl.so.2 could not be opened (%s): install NCCL or set "
                 "LD_LIBRARY_PATH to its lib folder", dlerror());
        return;
    }
    *(void **)&nccl.comm_init_all = dlsym(nccl.h, "ncclCommInitAll");
    *(void **)&nccl.comm_destroy = dlsym(nccl.h, "ncclCommDestroy");
    *(void **)&nccl.all_reduce = dlsym(nccl.h, "ncclAllReduce");
    *(void **)&nccl.all_gather = dlsym(nccl.h, "ncclAllGather");
    *(void **)&nccl.error_string = dlsym(nccl.h, "ncclGetErrorString");
    *(void **)&nccl.get_version = dlsym(nccl.h, "ncclGetVersion");
    *(void **)&nccl.comm_abort = dlsym(nccl.h, "ncclCommAbort");
    *(void **)&nccl.mem_alloc = dlsym(nccl.h, "ncclMemAlloc");
    *(void **)&nccl.mem_free = dlsym(nccl.h, "ncclMemFree");
    *(void **)&nccl.win_register = dlsym(nccl.h, "ncclCommWindowRegister");
    *(void **)&nccl.win_deregister = dlsym(nccl.h, "ncclCommWindowDeregister");
    *(void **)&nccl.group_start = dlsym(nccl.h, "ncclGroupStart");
    *(void **)&nccl.group_end = dlsym(nccl.h, "ncclGroupEnd");
    *(void **)&nccl.dev_create = dlsym(nccl.h, "ncclDevCommCreate");
    *(void **)&nccl.dev_destroy = dlsym(nccl.h, "ncclDevCommDestroy");
    if (!nccl.mem_alloc || !nccl.mem_free || !nccl.win_register || !nccl.win_deregister || !nccl.group_start ||
        !nccl.group_end || !nccl.dev_create || !nccl.dev_destroy)
        nccl.win_register = NULL; /* no device API: NCCL's own all-reduces only */
    if (!nccl.comm_abort || !nccl.comm_init_all || !nccl.comm_destroy || !nccl.all_reduce || !nccl.all_gather || !nccl.error_string ||
        !nccl.get_version) {
        snprintf(nccl_err, sizeof nccl_err, "libnccl.so.2 lacks the functions m40 calls (%s)", dlerror());
        dlclose(nccl.h);
        nccl.h = NULL;
    }
}

#endif /* M40_HAVE_NCCL_H */

struct m40_gpu_tp {
    int n;
    m40_gpu **ranks;
    /* n threads, the caller one of them: a job is n tasks, task r rank r's work, all of
     * them at once (util/threadpool.h) */
    m40_threadpool *crew;
    int *rc;              /* [n]: each rank's result of the job, and its message */
    char (*err)[256];
    pthread_mutex_t mu;   /* broken */
    int (*fn)(m40_gpu *g, void *ctx, char *err, size_t errlen);
    void *ctx;
    int abort_on_fail;    /* the job enqueues collectives: a rank that fails aborts them all */
    volatile int *abort_flag; /* mapped host memory the device all-reduce polls (group_abort sets it) */
    int broken;           /* aborted: every later job fails (the model must be loaded again) */
    int broken_rank;
};

#ifdef M40_HAVE_NCCL_H
/* Every rank's communicator ended by `end` (ncclCommDestroy, or ncclCommAbort where ranks
 * may be waiting in a collective), on its GPU, and forgotten. */
static void comms_end(struct m40_gpu_tp *t, ncclResult_t (*end)(ncclComm_t))
{
    for (int r = 0; r < t->n; r++)
        if (t->ranks[r] && t->ranks[r]->tp_comm) {
            cudaSetDevice(t->ranks[r]->device);
            end((ncclComm_t)t->ranks[r]->tp_comm);
            t->ranks[r]->tp_comm = NULL;
        }
}

/* The symmetric buffers: their windows deregistered (a collective call: grouped, as one
 * thread makes it for every rank) while the communicators live, then the memory freed. */
static void sym_free(struct m40_gpu_tp *t)
{
    int registered = 0, devcomms = 0;
    for (int r = 0; r < t->n; r++)
        if (t->ranks[r] && t->ranks[r]->tp_comm) {
            registered |= t->ranks[r]->tp_win[0] || t->ranks[r]->tp_win[1];
            devcomms |= t->ranks[r]->tp_devcomm_made;
        }
    if (devcomms) {
        nccl.group_start();
        for (int r = 0; r < t->n; r++) {
            m40_gpu *g = t->ranks[r];
            if (g && g->tp_comm && g->tp_devcomm_made) {
                cudaSetDevice(g->device);
                nccl.dev_destroy((ncclComm_t)g->tp_comm, g->tp_devcomm);
            }
        }
        nccl.group_end();
    }
    if (registered) {
        nccl.group_start();
        for (int r = 0; r < t->n; r++) {
            m40_gpu *g = t->ranks[r];
            if (!g || !g->tp_comm)
                continue;
            cudaSetDevice(g->device);
            for (int b = 0; b < 2; b++)
                if (g->tp_win[b])
                    nccl.win_deregister((ncclComm_t)g->tp_comm, (ncclWindow_t)g->tp_win[b]);
        }
        nccl.group_end();
    }
    for (int r = 0; r < t->n; r++) {
        m40_gpu *g = t->ranks[r];
        if (!g)
            continue;
        cudaSetDevice(g->device);
        for (int b = 0; b < 2; b++) {
            if (g->tp_sym[b])
                nccl.mem_free(g->tp_sym[b]);
            g->tp_sym[b] = NULL;
            g->tp_win[b] = NULL;
        }
        free(g->tp_devcomm);
        g->tp_devcomm = NULL;
        g->tp_abort = NULL;
        g->tp_devcomm_made = 0;
        g->tp_sym_floats = 0;
    }
}

/* The windows' sizes, a multiple of the GPUs' virtual-memory granularity (2 MiB), which
 * ncclMemAlloc allocates in. */
#define TP_SYM_ALIGN ((size_t)2 << 20)

/* Two buffers of rows x dim floats a rank from ncclMemAlloc, each registered in a
 * symmetric window (NCCL_WIN_COLL_SYMMETRIC; every rank's at the same offset, 0), and a
 * device communicator (ncclDevCommCreate) with the LSA barriers of m40k_tp_allreduce
 * (kernels.h 11), which sums a small product's partials straight from the peers' windows
 * (m40_gpu_tp_reduce_xd): the latency of NCCL's all-reduce of 16-64 KB was a large part
 * of a split model's decode step (BENCHMARKS.md, sessions 19 and 32). NCCL's own
 * symmetric kernels on these windows are not used: on NCCL 2.28.9 they summed wrong on
 * models of dim 64 and 256 (session 32). Any failure leaves the model on NCCL's
 * all-reduces in place on xd, with a line in the log. */
static void sym_init(struct m40_gpu_tp *t, int64_t rows)
{
    if (rows <= 0 || !nccl.win_register)
        return;
    const int64_t floats = rows * t->ranks[0]->p.dim;
    const size_t bytes = ((size_t)floats * 4 + TP_SYM_ALIGN - 1) / TP_SYM_ALIGN * TP_SYM_ALIGN;
    ncclResult_t r = ncclSuccess;
    for (int k = 0; k < t->n && r == ncclSuccess; k++) {
        m40_gpu *g = t->ranks[k];
        cudaSetDevice(g->device);
        for (int b = 0; b < 2 && r == ncclSuccess; b++)
            r = nccl.mem_alloc((void **)&g->tp_sym[b], bytes);
    }
    if (r == ncclSuccess) {
        r = nccl.group_start();
        for (int k = 0; k < t->n && r == ncclSuccess; k++) {
            m40_gpu *g = t->ranks[k];
            cudaSetDevice(g->device);
            for (int b = 0; b < 2 && r == ncclSuccess; b++)
                r = nccl.win_register((ncclComm_t)g->tp_comm, g->tp_sym[b], bytes, (ncclWindow_t *)&g->tp_win[b],
                                      NCCL_WIN_COLL_SYMMETRIC);
        }
        const ncclResult_t e = nccl.group_end();
        if (r == ncclSuccess)
            r = e;
    }
    for (int k = 0; k < t->n && r == ncclSuccess; k++)
        if (!t->ranks[k]->tp_win[0] || !t->ranks[k]->tp_win[1])
            r = ncclInternalError;
    _Alignas(16) char reqs[512]; /* an ncclDevCommRequirements (m40k_tp_devcomm_reqs) */
    const size_t dc_bytes = m40k_tp_devcomm_bytes();
    int have = 0;
    nccl.get_version(&have);
    const int built = m40k_tp_nccl_version();
    /* the exact release: 2.28.3's structures are not 2.28.9's (an H100 host with libnccl
     * 2.28.3 ran kernels built against 2.28.9's headers into an illegal address) */
    if (r == ncclSuccess && (!dc_bytes || !m40k_tp_devcomm_reqs(reqs, sizeof reqs) || have != built)) {
        fprintf(stderr, "m40: tensor parallelism: the kernels' NCCL device API is from NCCL %d.%d.%d (0: none), the "
                        "library is %d.%d.%d\n", built / 10000, built / 100 % 100, built % 100, have / 10000,
                have / 100 % 100, have % 100);
        r = ncclInvalidUsage;
    }
    for (int k = 0; k < t->n && r == ncclSuccess; k++)
        if (!(t->ranks[k]->tp_devcomm = calloc(1, dc_bytes)))
            r = ncclSystemError;
    if (r == ncclSuccess && !t->abort_flag) {
        void *f = NULL; /* portable and mapped: one address every GPU reads (UVA) */
        if (cudaHostAlloc(&f, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess)
            r = ncclSystemError;
        else
            *(volatile int *)f = 0, t->abort_flag = f;
    }
    for (int k = 0; k < t->n && r == ncclSuccess; k++)
        t->ranks[k]->tp_abort = (const int *)t->abort_flag;
    if (r == ncclSuccess) {
        r = nccl.group_start();
        for (int k = 0; k < t->n && r == ncclSuccess; k++) {
            m40_gpu *g = t->ranks[k];
            cudaSetDevice(g->device);
            r = nccl.dev_create((ncclComm_t)g->tp_comm, reqs, g->tp_devcomm);
        }
        const ncclResult_t e = nccl.group_end();
        if (r == ncclSuccess)
            r = e;
        for (int k = 0; k < t->n; k++) /* made, as far as the group says (else left, not destroyed) */
            t->ranks[k]->tp_devcomm_made = r == ncclSuccess;
    }
    if (r != ncclSuccess) {
        fprintf(stderr, "m40: tensor parallelism: NCCL's symmetric windows or device API unavailable (%s): NCCL's "
                        "all-reduces only\n", nccl.error_string(r));
        sym_free(t);
        return;
    }
    for (int k = 0; k < t->n; k++)
        t->ranks[k]->tp_sym_floats = floats;
    fprintf(stderr, "m40: tensor parallelism: steps of up to %lld rows all-reduce through NCCL's device API (2 x %.1f "
                    "MiB of symmetric windows a GPU)\n", (long long)rows, (double)bytes / 1048576.0);
}
#endif

/* A rank failed between collectives: the others may be waiting in one that it will
 * never join, so every communicator is aborted (NCCL ends the waiting kernels), once,
 * and the group takes no more work. */
static void group_abort(struct m40_gpu_tp *t, int rank)
{
    pthread_mutex_lock(&t->mu);
    const int first = !t->broken;
    t->broken = 1;
    if (first)
        t->broken_rank = rank;
    pthread_mutex_unlock(&t->mu);
    if (!first)
        return;
    fprintf(stderr, "m40: tensor-parallel rank %d failed inside a step: aborting the group's NCCL communicators; "
                    "this model answers no more requests until it is loaded again\n", rank);
    if (t->abort_flag) {
        /* the device all-reduces waiting for that rank end too (kernels.h 11): they poll
         * the flag every few tens of microseconds, and their barrier lives in the
         * communicators' memory, which the abort below frees, so they get 2 ms to see it
         * first; the ranks launch no more of them (m40_gpu_tp_reduce_xd) */
        *t->abort_flag = 1;
        __sync_synchronize();
        const struct timespec ms2 = {0, 2000000};
        nanosleep(&ms2, NULL);
    }
#ifdef M40_HAVE_NCCL_H
    comms_end(t, nccl.comm_abort);
#endif
}

/* Task r of a job: rank r's work on its GPU. */
static void rank_task(void *ctx, int rank, int thread)
{
    (void)thread;
    struct m40_gpu_tp *t = ctx;
    cudaSetDevice(t->ranks[rank]->device);
    t->err[rank][0] = '\0';
    t->rc[rank] = t->fn(t->ranks[rank], t->ctx, t->err[rank], sizeof t->err[rank]);
    if (t->rc[rank] != 0 && t->abort_on_fail)
        group_abort(t, rank);
}

m40_gpu *m40_gpu_tp_rank(const m40_gpu *g0, int r) { return g0->tp && r < g0->tp->n ? g0->tp->ranks[r] : NULL; }

int m40_gpu_tp_run(m40_gpu *g0, int (*fn)(m40_gpu *g, void *ctx, char *err, size_t errlen), void *ctx,
                   int abort_on_fail, char *err, size_t errlen)
{
    struct m40_gpu_tp *t = g0->tp;
    pthread_mutex_lock(&t->mu);
    if (t->broken) {
        pthread_mutex_unlock(&t->mu);
        m40_set_err(err, errlen, "the tensor-parallel group stopped after an error on rank %d: load the model again",
                    t->broken_rank);
        return -1;
    }
    pthread_mutex_unlock(&t->mu);
    t->fn = fn;
    t->ctx = ctx;
    t->abort_on_fail = abort_on_fail;
    m40_threadpool_run(t->crew, t->n, rank_task, t);
    cudaSetDevice(g0->device); /* the caller's thread ran some rank's task */
    for (int r = 0; r < t->n; r++)
        if (t->rc[r] != 0) {
            if (r == 0)
                m40_set_err(err, errlen, "%s", t->err[0]);
            else
                m40_set_err(err, errlen, "tensor-parallel rank %d: %s", r, t->err[r]);
            return -1;
        }
    return 0;
}

void m40_gpu_tp_free(m40_gpu *g0)
{
    struct m40_gpu_tp *t = g0 ? g0->tp : NULL;
    if (!t)
        return;
    m40_threadpool_free(t->crew);
#ifdef M40_HAVE_NCCL_H
    sym_free(t);
    comms_end(t, nccl.comm_destroy);
#endif
    if (t->abort_flag)
        cudaFreeHost((void *)t->abort_flag);
    for (int r = 1; r < t->n; r++)
        m40_gpu_free(t->ranks[r]);
    pthread_mutex_destroy(&t->mu);
    free(t->rc);
    free(t->err);
    free(t->ranks);
    free(t);
    g0->tp = NULL;
}

int m40_gpu_tp_init(m40_gpu **ranks, int n, int64_t sym_rows, char *err, size_t errlen)
{
#ifndef M40_HAVE_NCCL_H
    (void)ranks;
    (void)n;
    (void)sym_rows;
    m40_set_err(err, errlen, "tensor parallelism needs NCCL, and this build found no nccl.h");
    return -1;
#else
    /* NVLink SHARP (multicast) stays off unless the operator turned it on: m40 never
     * measured it, and on shared hosts it can take the GPUs out of service */
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    pthread_once(&nccl_once, nccl_open);
    if (!nccl.h) {
        m40_set_err(err, errlen, "%s", nccl_err);
        return -1;
    }
    int *devs = calloc((size_t)n, sizeof *devs);
    ncclComm_t *comms = calloc((size_t)n, sizeof *comms);
    struct m40_gpu_tp *t = calloc(1, sizeof *t);
    if (!devs || !comms || !t || !(t->ranks = calloc((size_t)n, sizeof *t->ranks)) ||
        !(t->rc = calloc((size_t)n, sizeof *t->rc)) || !(t->err = calloc((size_t)n, sizeof *t->err))) {
        m40_set_err(err, errlen, "out of memory");
        goto fail;
    }
    for (int r = 0; r < n; r++)
        devs[r] = ranks[r]->device;
    ncclResult_t nr = nccl.comm_init_all(comms, n, devs);
    if (nr != ncclSuccess) {
        m40_set_err(err, errlen, "NCCL: ncclCommInitAll over %d GPUs failed: %s", n, nccl.error_string(nr));
        goto fail;
    }
    int version = 0;
    nccl.get_version(&version);
    fprintf(stderr, "m40: tensor parallelism over %d GPUs (devices %d..%d), NCCL %d.%d.%d\n", n, devs[0],
            devs[n - 1], version / 10000, version / 100 % 100, version % 100);
    t->n = n;
    pthread_mutex_init(&t->mu, NULL);
    for (int r = 0; r < n; r++) {
        t->ranks[r] = ranks[r];
        ranks[r]->tp_comm = comms[r];
        ranks[r]->tp_rank = r;
        ranks[r]->tp_n = n;
    }
    ranks[0]->tp = t;
    sym_init(t, sym_rows);
    if (!(t->crew = m40_threadpool_new(n))) {
        m40_set_err(err, errlen, "cannot start the %d threads of tensor parallelism", n);
        goto fail_started; /* tp_free frees the ranks past 0 and the communicators */
    }
    free(devs);
    free(comms);
    return 0;
fail_started:
    for (int r = 1; r < n; r++)
        ranks[r] = NULL; /* now the group's */
    m40_gpu_tp_free(ranks[0]);
    free(devs);
    free(comms);
    return -1;
fail:
    free(devs);
    free(comms);
    if (t) {
        free(t->ranks);
        free(t->rc);
        free(t->err);
        free(t);
    }
    return -1;
#endif
}

/* An event on rank 0's stream around each collective while steps are timed (bench
 * --gpu-time) and not captured into a graph (M40_CUDA_GRAPHS=0): the collectives' share of
 * a step, as the card saw it (waiting for the other ranks included). */
static void time_mark(m40_gpu *g)
{
    enum cudaStreamCaptureStatus cs;
    if (!g->time_steps || g->tp_rank != 0 || cudaStreamIsCapturing(g->stream, &cs) != cudaSuccess ||
        cs != cudaStreamCaptureStatusNone)
        return;
    if (g->tp_ev_used == g->tp_ev_cap) {
        int cap = g->tp_ev_cap ? 2 * g->tp_ev_cap : 512;
        cudaEvent_t *ev = realloc(g->tp_ev, (size_t)cap * sizeof *ev);
        if (!ev)
            return;
        g->tp_ev = ev;
        for (int i = g->tp_ev_cap; i < cap; i++)
            if (cudaEventCreate(&ev[i]) != cudaSuccess)
                return; /* the events made so far stay usable; cap grows next time */
            else
                g->tp_ev_cap = i + 1;
    }
    cudaEventRecord(g->tp_ev[g->tp_ev_used++], g->stream);
}

void m40_gpu_tp_time_step(m40_gpu *g)
{
    for (int i = 0; i + 1 < g->tp_ev_used; i += 2) {
        float ms = 0;
        if (cudaEventElapsedTime(&ms, g->tp_ev[i], g->tp_ev[i + 1]) == cudaSuccess) {
            g->tp_coll_ms += ms;
            g->tp_coll_calls++;
        }
    }
    g->tp_ev_used = 0;
}

void m40_gpu_tp_time(const m40_gpu *g, double *ms, int64_t *calls)
{
    *ms = g->tp_coll_ms;
    *calls = g->tp_coll_calls;
}

#ifdef M40_HAVE_NCCL_H
/* The caller's error names the call and says "unknown error" (a CUDA code stands for it):
 * NCCL's own words go to the log, where the operator looks (an NCCL_ALGO that has no
 * all-gather, Tree for one, fails the logits' gather of the first step). */
static int nccl_failed(const m40_gpu *g, const char *what, ncclResult_t r)
{
    fprintf(stderr, "m40: gpu %d (tensor-parallel rank %d of %d): %s failed: NCCL: %s\n", g->device, g->tp_rank,
            g->tp_n, what, nccl.error_string(r));
    return (int)cudaErrorUnknown;
}
#endif

int m40_gpu_tp_all_reduce(m40_gpu *g, float *buf, size_t count)
{
#ifdef M40_HAVE_NCCL_H
    time_mark(g);
    ncclResult_t r = nccl.all_reduce(buf, buf, count, ncclFloat32, ncclSum, (ncclComm_t)g->tp_comm, g->stream);
    time_mark(g);
    return r == ncclSuccess ? 0 : nccl_failed(g, "ncclAllReduce", r);
#else
    (void)g, (void)buf, (void)count;
    return (int)cudaErrorNotSupported;
#endif
}

int m40_gpu_tp_reduce_xd(m40_gpu *g, size_t count)
{
#ifdef M40_HAVE_NCCL_H
    const int b = g->xd == g->tp_sym[0] ? 0 : g->xd == g->tp_sym[1] ? 1 : -1;
    if (b < 0)
        return m40_gpu_tp_all_reduce(g, g->xd, count);
    if ((int64_t)count > g->tp_sym_floats) /* enqueue_step chose the windows for a step that fits */
        return (int)cudaErrorInvalidValue;
    if (g->tp_abort && *(const volatile int *)g->tp_abort) /* the group was aborted (group_abort) */
        return (int)cudaErrorLaunchFailure;
    float *to = g->tp_sym[1 - b];
    time_mark(g);
    const int e = m40k_tp_allreduce(g->tp_devcomm, g->tp_win[b], 0, to, (int64_t)count, g->tp_abort, g->stream);
    time_mark(g);
    g->xd = to;
    return e;
#else
    return m40_gpu_tp_all_reduce(g, g->xd, count);
#endif
}

int m40_gpu_tp_all_gather(m40_gpu *g, const float *send, float *recv, size_t count)
{
#ifdef M40_HAVE_NCCL_H
    time_mark(g);
    ncclResult_t r = nccl.all_gather(send, recv, count, ncclFloat32, (ncclComm_t)g->tp_comm, g->stream);
    time_mark(g);
    return r == ncclSuccess ? 0 : nccl_failed(g, "ncclAllGather", r);
#else
    (void)g, (void)send, (void)recv, (void)count;
    return (int)cudaErrorNotSupported;
#endif
}

/* ------------------------------------------------------------- loading ---- */

/* Steps whose all-reduce has each rank read at most this many bytes of its peers' parts
 * ((n - 1) x rows x dim x 4) go through m40k_tp_allreduce, larger ones through NCCL's
 * ncclAllReduce in place on xd: the former's ranks each read every other rank's whole
 * part, where NCCL's ring moves 2 (n - 1) / n of the product, so it pays where latency
 * rules. The bound sits between the batches where it won (1 and 1.5 MiB read) and the one
 * where it lost (3 MiB): BENCHMARKS.md, session 32. */
#define TP_AR_READ_BYTES ((int64_t)2 << 20)

static int64_t tp_sym_rows(const m40_gpu *g, int n)
{
    const int64_t per_row = (int64_t)(n - 1) * g->p.dim * 4, rows = per_row > 0 ? TP_AR_READ_BYTES / per_row : 0;
    return rows < 1 ? 1 : rows > 1024 ? 1024 : rows;
}

/* A split model's upload: each rank's shard (model/tp_shard.h) on its GPU, every rank at
 * once from a thread each (each reads its own part of the mmap), then the group. */
typedef struct {
    m40_gpu_src src;
    m40_model_params p;
    m40_tp_shard shard;
    const m40_tuning *t;
    int device, log;
    m40_gpu *g;
    int rc, started;
    char err[512];
} rank_load;

static void *rank_load_main(void *arg)
{
    rank_load *j = arg;
    j->rc = m40_gpu_load(&j->src, j->t, j->device, j->log, &j->g, j->err, sizeof j->err);
    return NULL;
}

int m40_gpu_load_tp(const m40_gpu_src *src, const m40_tuning *t, int device, int n, int log_progress, m40_gpu **out,
                    char *err, size_t errlen)
{
    *out = NULL;
    if (n <= 1)
        return m40_gpu_load(src, t, device, log_progress, out, err, errlen);
    if (t->batch_invariant) { /* NCCL's all-reduce sums in an order that depends on the step's size */
        m40_set_err(err, errlen, "batch invariance does not run with tensor parallelism yet (tp=%d): use tp=1", n);
        return -1;
    }
    if (m40_tp_check(src->p, src->layers, n, err, errlen))
        return -1;
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess)
        n_dev = 0;
    if (device < 0 || device + n > n_dev) {
        m40_set_err(err, errlen, "tp=%d from device %d needs CUDA devices %d..%d, but there are %d", n, device, device,
                    device + n - 1, n_dev);
        return -1;
    }
    rank_load *jobs = calloc((size_t)n, sizeof *jobs);
    pthread_t *th = calloc((size_t)n, sizeof *th);
    m40_gpu **gs = calloc((size_t)n, sizeof *gs);
    int rc = -1;
    if (!jobs || !th || !gs) {
        m40_set_err(err, errlen, "out of memory");
        goto out;
    }
    for (int r = 0; r < n; r++) {
        rank_load *j = &jobs[r];
        if (m40_tp_shard_make(src->p, src->output, src->layers, r, n, &j->shard, err, errlen))
            goto out;
        m40_tp_shard_params(&j->shard, src->p, &j->p);
        j->src = *src;
        j->src.p = &j->p;
        j->src.q_dim = j->shard.q_dim;
        j->src.kv_dim = j->shard.kv_dim;
        j->src.output = &j->shard.output;
        j->src.layers = j->shard.layers;
        j->t = t;
        j->device = device + r;
        j->log = log_progress;
    }
    /* every rank's upload at once: each reads its own shard of the mmap */
    for (int r = 1; r < n; r++) {
        if (pthread_create(&th[r], NULL, rank_load_main, &jobs[r]) != 0) {
            jobs[r].rc = -1;
            snprintf(jobs[r].err, sizeof jobs[r].err, "cannot start a loading thread");
            continue;
        }
        jobs[r].started = 1;
    }
    rank_load_main(&jobs[0]);
    for (int r = 1; r < n; r++)
        if (jobs[r].started)
            pthread_join(th[r], NULL);
    for (int r = 0; r < n; r++)
        if (jobs[r].rc != 0) {
            m40_set_err(err, errlen, "tensor-parallel rank %d: %s", r, jobs[r].err);
            goto out;
        }
    for (int r = 0; r < n; r++) {
        m40_gpu *g = gs[r] = jobs[r].g;
        jobs[r].g = NULL;
        g->tp_vocab_rows = jobs[r].shard.vocab_rows;
        g->tp_vocab_stride = jobs[r].shard.vocab_stride;
        /* the GEMVs that add their output into the residual or pick the token need the
         * whole sum: a rank has its part of it until the all-reduce */
        g->fuse_norm = 0;
        g->fuse_pick = 0;
    }
    if (m40_gpu_tp_init(gs, n, t->tp_symmetric ? tp_sym_rows(gs[0], n) : 0, err, errlen))
        goto out;
    *out = gs[0];
    gs[0] = NULL;
    for (int r = 1; r < n; r++)
        gs[r] = NULL; /* the group's now */
    rc = 0;
out:
    for (int r = 0; jobs && r < n; r++) {
        m40_gpu_free(jobs[r].g);
        m40_tp_shard_free(&jobs[r].shard);
    }
    for (int r = 0; gs && r < n; r++)
        m40_gpu_free(gs[r]);
    free(jobs);
    free(th);
    free(gs);
    return rc;
}

#endif /* M40_HAVE_CUDA */
