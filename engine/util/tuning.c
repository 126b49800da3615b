/* The tuning switches, read from the environment (see tuning.h). Each keeps the reading
 * it always had, so that the values users and BENCHMARKS.md give still mean the same. */
#include "tuning.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* 1 unless the variable is "0": a switch that is on by default. */
static int on_unless_zero(const char *name)
{
    const char *v = getenv(name);
    return !(v && strcmp(v, "0") == 0);
}

void m40_tuning_from_env(m40_tuning *t)
{
    memset(t, 0, sizeof *t);
    const char *gm = getenv("M40_GEMM");
    if (gm && !strcmp(gm, "f16"))
        t->gemm = M40_GEMM_F16;
    else if (gm && !strcmp(gm, "f32"))
        t->gemm = M40_GEMM_F32;
    else if (gm)
        snprintf(t->gemm_ignored, sizeof t->gemm_ignored, "%s", gm);
    t->pdl = on_unless_zero("M40_PDL");
    t->clusters = on_unless_zero("M40_CLUSTER");
    t->dec_hsplit = on_unless_zero("M40_DEC_HSPLIT");
    t->skinny = on_unless_zero("M40_SKINNY");
    const char *cg = getenv("M40_CUDA_GRAPHS");
    t->cuda_graphs = cg && *cg ? atoi(cg) : 64;
    if (t->cuda_graphs < 0)
        t->cuda_graphs = 0;
    t->warmup = on_unless_zero("M40_WARMUP");
    t->g8 = on_unless_zero("M40_G8");
    t->moe_pad = on_unless_zero("M40_MOE_PAD");
    t->moe_q8 = on_unless_zero("M40_MOE_Q8");
    t->fuse_norm = on_unless_zero("M40_FUSE_NORM");
    t->fuse_pick = on_unless_zero("M40_FUSE_PICK");
    t->prefill_f16 = on_unless_zero("M40_PREFILL_F16");
    t->fuse_residual = on_unless_zero("M40_FUSE_RESIDUAL");
    t->gemm_q = on_unless_zero("M40_GEMM_Q");
    const char *mr = getenv("M40_GEMM_Q_ROWS");
    t->gemm_q_rows = mr ? atoi(mr) : 128;
    const char *mg = getenv("M40_GEMM_Q_REG");
    t->gemm_q_reg = mg ? atoi(mg) : 64;
    const char *gv = getenv("M40_GEMV_ROWS");
    t->gemv_rows = gv && *gv ? atoi(gv) : 2;
    t->gemv_rows = t->gemv_rows < 1 ? 1 : t->gemv_rows > 8 ? 8 : t->gemv_rows; /* one row: always a GEMV */
    const char *mgr = getenv("M40_MOE_GEMM_REG");
    t->moe_gemm_reg = mgr && *mgr ? atoi(mgr) : 64;
    const char *mv = getenv("M40_MOE_GEMV_ROWS");
    t->moe_gemv_rows = mv && *mv ? atoi(mv) : -1; /* unset: by the experts' type (model_cuda_fwd.c) */
    if (mv && *mv && t->moe_gemv_rows < 0)
        t->moe_gemv_rows = 0;
    const char *kb = getenv("M40_KV_BLOCKS");
    t->kv_blocks = kb && atoll(kb) > 0 ? atoll(kb) : 0;
    t->prefix_cache = on_unless_zero("M40_PREFIX_CACHE");
    const char *ld = getenv("M40_TEST_LOAD_DELAY_MS");
    t->load_delay_ms = ld && atoi(ld) > 0 ? atoi(ld) : 0;
    t->gpu_sample = on_unless_zero("M40_GPU_SAMPLE");
    t->tp_symmetric = on_unless_zero("M40_TP_SYMMETRIC");
    const char *pt = getenv("M40_PICK_THREADS");
    t->pick_threads = pt && *pt && atoi(pt) >= 0 ? atoi(pt) : -1;
    if (t->pick_threads > 64)
        t->pick_threads = 64;
    const char *bi = getenv("M40_BATCH_INVARIANT");
    t->batch_invariant = bi && atoi(bi) == 1;
    const char *gu = getenv("M40_GPU_UNVALIDATED");
    t->gpu_unvalidated = gu && atoi(gu) == 1;
}

int m40_tuning_line(const m40_tuning *t, char *buf, size_t len)
{
    static const char *const gemm[] = {"auto", "f16", "f32"};
    char pick[16] = "auto", moe_rows[16] = "auto";
    if (t->pick_threads >= 0)
        snprintf(pick, sizeof pick, "%d", (int)t->pick_threads);
    if (t->moe_gemv_rows >= 0)
        snprintf(moe_rows, sizeof moe_rows, "%d", (int)t->moe_gemv_rows);
    return snprintf(buf, len,
                    "M40_GEMM=%s M40_PDL=%d M40_CLUSTER=%d M40_DEC_HSPLIT=%d M40_SKINNY=%d M40_CUDA_GRAPHS=%d M40_WARMUP=%d "
                    "M40_G8=%d M40_FUSE_NORM=%d M40_FUSE_PICK=%d M40_PREFILL_F16=%d M40_FUSE_RESIDUAL=%d M40_GEMM_Q=%d M40_GEMM_Q_ROWS=%d "
                    "M40_GEMM_Q_REG=%d M40_GEMV_ROWS=%d M40_MOE_GEMV_ROWS=%s M40_MOE_GEMM_REG=%d M40_MOE_PAD=%d M40_MOE_Q8=%d M40_KV_BLOCKS=%lld M40_PREFIX_CACHE=%d "
                    "M40_PICK_THREADS=%s M40_GPU_SAMPLE=%d M40_TP_SYMMETRIC=%d M40_BATCH_INVARIANT=%d M40_GPU_UNVALIDATED=%d",
                    gemm[t->gemm], t->pdl, t->clusters, t->dec_hsplit, t->skinny, t->cuda_graphs, t->warmup, t->g8, t->fuse_norm,
                    t->fuse_pick, t->prefill_f16, t->fuse_residual, t->gemm_q, (int)t->gemm_q_rows, (int)t->gemm_q_reg, (int)t->gemv_rows,
                    moe_rows, (int)t->moe_gemm_reg, t->moe_pad, t->moe_q8, (long long)t->kv_blocks, t->prefix_cache, pick, t->gpu_sample, t->tp_symmetric, t->batch_invariant, t->gpu_unvalidated);
}
