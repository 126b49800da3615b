/* Tensor parallelism on GPUs (engine/gpu/tp.c over NCCL): the same files as the CPU
 * twin's test (tests/unit/test_tp.c) loaded with tp = 1 and tp = 2 (and 4 where the
 * host has 4 GPUs) from device 0 give the same logits within 1e-2 of each row's
 * largest and the same greedy picks (but for near ties): mixed prefill batches, decode
 * steps through the CUDA graphs (the steps repeat a shape), F16, Q8_0 (regrouped) and
 * Q4_K_M (Q4_K and Q6_K strided column runs packed at upload). Skips with fewer than
 * 2 GPUs. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <unistd.h>

#include "check.h"
#include "gguf/mkmodel.h"
#include "tp_compare.h"

static int make(const char *shape, m40_mkmodel_ftype t, const char *path)
{
    m40_mkmodel_opts o = {.shape = m40_mkmodel_find_shape(shape), .ftype = t, .seed = 7};
    char err[256];
    int rc = m40_mkmodel_write(&o, path, NULL, err, sizeof err);
    CHECK(rc == 0, "mkmodel %s: %s", shape, err);
    return rc;
}

int main(void)
{
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 2) {
        SKIP("tensor parallelism needs 2 GPUs, this host has %d", n_dev);
        return check_done();
    }
    char dir[] = "/tmp/m40-test-tp-gpu-XXXXXX";
    if (!mkdtemp(dir)) {
        SKIP("no temporary directory");
        return check_done();
    }
    const struct { m40_mkmodel_ftype t; const char *name; } types[] = {
        {M40_MK_F16, "F16"}, {M40_MK_Q8_0, "Q8_0"}, {M40_MK_Q4_K_M, "Q4_K_M"}};
    for (size_t i = 0; i < 3; i++) {
        char path[300], label[64];
        snprintf(path, sizeof path, "%s/tiny-tp-%s.gguf", dir, types[i].name);
        snprintf(label, sizeof label, "gpu tiny-tp %s", types[i].name);
        if (make("tiny-tp", types[i].t, path))
            continue;
        tpc_compare(path, label, 0, 2, 1e-2);
        if (n_dev >= 4)
            tpc_compare(path, label, 0, 4, 1e-2);
        unlink(path);
    }
    const char *shared[] = {"models/stories260K.gguf", "models/tiny-llama-spm-gqa-f16.gguf",
                            "models/tiny-qwen2-gpt2-f16.gguf", "models/tiny-llama-q8_0.gguf",
                            "models/next/tiny-qwen3-gpt2-f16.gguf", "models/next/tiny-gemma2-f16.gguf",
                            "models/next/tiny-phi3-f16.gguf"};
    for (size_t i = 0; i < sizeof shared / sizeof shared[0]; i++) {
        char path[4096];
        if (!check_shared_file(shared[i], path, sizeof path)) {
            SKIP("%s absent (../shared)", shared[i]);
            continue;
        }
        tpc_compare(path, shared[i], 0, 2, 1e-2);
        if (n_dev >= 4 && i == 0) /* stories260K: 8 heads, 4 KV heads */
            tpc_compare(path, shared[i], 0, 4, 1e-2);
    }
    rmdir(dir);
    return check_done();
}
