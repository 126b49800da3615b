/* The tuning switches (engine/util/tuning.c) read the environment as the code that read
 * each of them before did: unset means the default, "0" turns an on-by-default switch
 * off and any other value leaves it on, numbers as atoi/atoll read them. */
#include <stddef.h>

#include "check.h"
#include "util/tuning.h"

static const char *const names[] = {"M40_GEMM", "M40_PDL", "M40_CLUSTER", "M40_SKINNY", "M40_CUDA_GRAPHS",
                                    "M40_WARMUP", "M40_G8", "M40_FUSE_NORM", "M40_FUSE_PICK", "M40_GEMM_Q",
                                    "M40_GEMM_Q_ROWS", "M40_GEMM_Q_REG", "M40_KV_BLOCKS", "M40_PREFIX_CACHE",
                                    "M40_GPU_UNVALIDATED", "M40_MOE_GEMV_ROWS", "M40_PICK_THREADS", "M40_GPU_SAMPLE",
                                    "M40_GEMV_ROWS", "M40_PREFILL_F16", "M40_FUSE_RESIDUAL", "M40_MOE_GEMM_REG",
                                    "M40_MOE_PAD", "M40_MOE_Q8", "M40_DEC_HSPLIT", "M40_TP_SYMMETRIC",
                                    "M40_BATCH_INVARIANT"};

static void clear(void)
{
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        unsetenv(names[i]);
}

int main(void)
{
    m40_tuning t;
    clear();
    m40_tuning_from_env(&t);
    CHECK(t.gemm == M40_GEMM_AUTO && !t.gemm_ignored[0], "M40_GEMM unset: auto");
    CHECK(t.pdl && t.clusters && t.skinny && t.warmup && t.g8 && t.fuse_norm && t.fuse_pick && t.gemm_q &&
              t.prefix_cache && t.gpu_sample && t.prefill_f16 && t.fuse_residual && t.moe_pad && t.moe_q8 &&
              t.dec_hsplit && t.tp_symmetric,
          "every on/off switch on by default");
    CHECK(t.cuda_graphs == 64 && t.gemm_q_rows == 128 && t.gemm_q_reg == 64 && t.kv_blocks == 0, "numbers' defaults");
    CHECK(t.moe_gemv_rows == -1, "M40_MOE_GEMV_ROWS unset: -1 (by the experts' type)");
    CHECK(t.moe_gemm_reg == 64, "M40_MOE_GEMM_REG unset: 64");
    CHECK(t.gemv_rows == 2, "M40_GEMV_ROWS unset: 2");
    CHECK(t.pick_threads == -1, "M40_PICK_THREADS unset: -1 (the engine's default for its device)");
    /* the opt-in switches: off unset, off at any value but 1, on at 1 */
    static const struct {
        const char *name;
        size_t off;
    } opt_in[] = {{"M40_GPU_UNVALIDATED", offsetof(m40_tuning, gpu_unvalidated)},
                  {"M40_BATCH_INVARIANT", offsetof(m40_tuning, batch_invariant)}};
    for (size_t i = 0; i < sizeof opt_in / sizeof opt_in[0]; i++) {
        const char *v[] = {NULL, "yes", "1"};
        for (int k = 0; k < 3; k++) {
            if (v[k])
                setenv(opt_in[i].name, v[k], 1);
            m40_tuning_from_env(&t);
            const int on = *(const int *)((const char *)&t + opt_in[i].off);
            CHECK(on == (k == 2), "%s=%s: %s", opt_in[i].name, v[k] ? v[k] : "(unset)", on ? "on" : "off");
        }
        unsetenv(opt_in[i].name);
    }

    for (size_t i = 1; i < sizeof names / sizeof names[0]; i++)
        setenv(names[i], "0", 1);
    m40_tuning_from_env(&t);
    CHECK(!t.pdl && !t.clusters && !t.skinny && !t.warmup && !t.g8 && !t.fuse_norm && !t.fuse_pick && !t.gemm_q &&
              !t.prefix_cache && !t.gpu_sample && !t.prefill_f16 && !t.fuse_residual && !t.moe_pad && !t.moe_q8 &&
              !t.dec_hsplit && !t.tp_symmetric,
          "\"0\" turns each off");
    CHECK(t.cuda_graphs == 0 && t.gemm_q_rows == 0 && t.gemm_q_reg == 0 && t.kv_blocks == 0 &&
              t.moe_gemv_rows == 0 && t.pick_threads == 0 && t.moe_gemm_reg == 0,
          "numbers at 0");
    CHECK(t.gemv_rows == 1, "M40_GEMV_ROWS=0 reads as 1 (a row alone always takes a GEMV)");

    clear();
    setenv("M40_PDL", "no", 1);
    setenv("M40_CUDA_GRAPHS", "", 1);
    setenv("M40_GEMM_Q_ROWS", "32", 1);
    setenv("M40_KV_BLOCKS", "12", 1);
    setenv("M40_MOE_GEMV_ROWS", "3", 1);
    setenv("M40_MOE_GEMM_REG", "16", 1);
    setenv("M40_PICK_THREADS", "4", 1);
    setenv("M40_GEMV_ROWS", "5", 1);
    setenv("M40_GEMM", "f32", 1);
    m40_tuning_from_env(&t);
    CHECK(t.pdl, "a value other than \"0\" leaves a switch on");
    CHECK(t.cuda_graphs == 64, "an empty M40_CUDA_GRAPHS: the default (%d)", t.cuda_graphs);
    CHECK(t.gemm_q_rows == 32 && t.kv_blocks == 12 && t.moe_gemv_rows == 3 && t.pick_threads == 4 &&
              t.gemv_rows == 5 && t.moe_gemm_reg == 16,
          "numbers read");
    CHECK(t.gemm == M40_GEMM_F32, "f32");
    setenv("M40_CUDA_GRAPHS", "-5", 1);
    setenv("M40_KV_BLOCKS", "-5", 1);
    setenv("M40_GEMM", "bf16", 1);
    setenv("M40_PICK_THREADS", "-2", 1);
    setenv("M40_GEMV_ROWS", "12", 1);
    m40_tuning_from_env(&t);
    CHECK(t.gemv_rows == 8, "M40_GEMV_ROWS past 8: 8 (the GEMVs' most)");
    CHECK(t.pick_threads == -1, "a negative M40_PICK_THREADS: the default");
    CHECK(t.cuda_graphs == 0 && t.kv_blocks == 0, "negative numbers: none");
    CHECK(t.gemm == M40_GEMM_AUTO && !strcmp(t.gemm_ignored, "bf16"), "an unknown M40_GEMM is ignored, and kept to say so");
    setenv("M40_GEMM", "f16", 1);
    m40_tuning_from_env(&t);
    char line[512];
    m40_tuning_line(&t, line, sizeof line);
    CHECK(strstr(line, "M40_GEMM=f16 ") && strstr(line, "M40_KV_BLOCKS=0 ") && strstr(line, "M40_CUDA_GRAPHS=0 ") &&
              strstr(line, "M40_PICK_THREADS=auto ") &&
              strstr(line, "M40_GEMV_ROWS=8 ") && strstr(line, "M40_MOE_GEMM_REG=16 ") &&
              strstr(line, "M40_MOE_PAD=1 ") && strstr(line, "M40_MOE_Q8=1 ") && strstr(line, "M40_MOE_GEMV_ROWS=3 ") &&
              strstr(line, "M40_BATCH_INVARIANT=0 ") && strstr(line, "M40_GPU_UNVALIDATED=0"),
          "the log line: %s", line);
    clear();
    return check_done();
}
