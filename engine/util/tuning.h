/* The engine's tuning switches: environment variables that turn one optimization off
 * or cap one size, to measure it or to work around it (README.md, "Supported models",
 * says what each does). They are read in one place, once per model load
 * (m40_tuning_from_env), kept with the model, and logged once when a GPU model loads;
 * the GPU back end, the KV pool, the warm-up and the kernels (through their arguments)
 * take their values from here, and nothing else of the engine or kernels/ calls getenv.
 * nginx hands its workers an empty environment: nginx.conf passes a switch with `env`. */
#ifndef M40_TUNING_H
#define M40_TUNING_H

#include <stddef.h>
#include <stdint.h>

enum { M40_GEMM_AUTO = 0, M40_GEMM_F16 = 1, M40_GEMM_F32 = 2 };

typedef struct {
    int gemm;             /* M40_GEMM=f16|f32: the tiled products' precision; else M40_GEMM_AUTO
                           * (F32 under 1B parameters, F16 from there) */
    char gemm_ignored[32];/* M40_GEMM's value when it was neither f16 nor f32 ("": none) */
    int pdl;              /* M40_PDL=0: no programmatic dependent launch on Hopper */
    int clusters;         /* M40_CLUSTER=0: no thread block clusters in the decode attention */
    int dec_hsplit;       /* M40_DEC_HSPLIT=0: the clustered decode attention of small batches
                           * keeps a block for all the query heads of a KV head */
    int skinny;           /* M40_SKINNY=0: no tensor-core GEMV for F16 decode products */
    int cuda_graphs;      /* M40_CUDA_GRAPHS=N: decode steps of up to N sequences as CUDA graphs
                           * (default 64; 0: none) */
    int warmup;           /* M40_WARMUP=0: no GPU warm-up before READY */
    int g8;               /* M40_G8=0: Q8_0 and Q6_K keep the file's layout on the GPU */
    int moe_pad;          /* M40_MOE_PAD=0: Q6_K and MXFP4 experts keep the file's layout on the
                           * GPU (not padded to 16-byte aligned blocks) */
    int moe_q8;           /* M40_MOE_Q8=0: a decode row's expert GEMVs on F32 x and h instead of
                           * their int8 records */
    int fuse_norm;        /* M40_FUSE_NORM=0: batch-1 decode keeps its add+RMSNorm kernels */
    int fuse_pick;        /* M40_FUSE_PICK=0: a greedy row's pick by the sampling kernel */
    int fuse_residual;    /* M40_FUSE_RESIDUAL=0: the tiled (cuBLAS) products feeding the residual
                           * write their output for the add + RMSNorm instead of adding into it */
    int prefill_f16;      /* M40_PREFILL_F16=0: prompt chunks keep F32 outputs of the gate/up
                           * product (cuBLAS) and of the attention where the next kernel reads F16 */
    int gemm_q;           /* M40_GEMM_Q=0: quantized products of more than 8 rows dequantize
                           * to F16 and go through cuBLAS */
    int32_t gemm_q_rows;  /* M40_GEMM_Q_ROWS=N: only products of up to N rows take the
                           * quantized GEMM, larger ones dequantize to F16 for cuBLAS
                           * (default 128; 0: all take it) */
    int32_t gemm_q_reg;   /* M40_GEMM_Q_REG=N: products of up to N rows take the quantized
                           * GEMM's register kernel (default 64) */
    int32_t gemv_rows;    /* M40_GEMV_ROWS=N: quantized products of up to N rows (1..8) take the
                           * GEMVs, of N+1..8 rows the quantized GEMM's register kernel where
                           * it reads the type (default 2; 8: the GEMVs up to 8 rows; 0 reads as 1) */
    int32_t moe_gemm_reg; /* M40_MOE_GEMM_REG=N: tiles of up to N rows of the experts' grouped
                           * products take the register kernel (default 64; 0: the
                           * shared-memory kernel) */
    int32_t moe_gemv_rows;/* M40_MOE_GEMV_ROWS=N: mixture-of-experts steps of up to N rows take
                           * the expert GEMVs, larger ones the grouped products (0: every step
                           * grouped); unset (-1): 4 rows where the GEMVs read int8 records,
                           * else 1, or none for gpt-oss's MXFP4 experts (model_cuda_fwd.c) */
    int64_t kv_blocks;    /* M40_KV_BLOCKS=N: the GPU KV pool holds at most N blocks (a test
                           * seam; 0: no cap) */
    int prefix_cache;     /* M40_PREFIX_CACHE=0: the GPU KV pool caches no prefixes */
    int32_t load_delay_ms;/* M40_TEST_LOAD_DELAY_MS=N: the engine waits N ms before it loads
                           * its model (a test seam: a model that takes a while to load) */
    int32_t pick_threads; /* M40_PICK_THREADS=N: helper threads of the engine's steps (grammar
                           * masks during the forward pass, the rows' picks; 0: none); unset
                           * (-1): half the CPUs, 2..8, on a GPU engine, none on the CPU one */
    int gpu_sample;       /* M40_GPU_SAMPLE=0: every sampled (not greedy) row's draw on the host */
    int tp_symmetric;     /* M40_TP_SYMMETRIC=0: a tensor-parallel model's all-reduces stay in
                           * place on its scratch, without NCCL's symmetric windows */
    int batch_invariant;  /* M40_BATCH_INVARIANT=1 (or m40_model_options.batch_invariant): every
                           * row of a step computed as it would be alone (model_cuda_fwd.c,
                           * inv_*: one kernel and split a product, whatever the batch); off
                           * by default: slower */
    int gpu_unvalidated;  /* M40_GPU_UNVALIDATED=1: a GPU loads an architecture whose row is not
                           * gpu_validated (a test seam to validate it without a rebuild;
                           * logged loudly at every such load) */
} m40_tuning;

/* Reads every switch from the environment (unset or unparsable: the default). */
void m40_tuning_from_env(m40_tuning *t);
/* The values as one line of NAME=value pairs, for the load log. Returns snprintf's. */
int m40_tuning_line(const m40_tuning *t, char *buf, size_t len);

#endif
