/* CPU dequantization and dot products for GGUF weight types. These are the reference
 * semantics every GPU kernel is compared with. Block layouts follow the GGUF/ggml
 * definitions (Q8_0: fp16 d + 32 x int8; Q4_K: fp16 d, dmin, 12 bytes of 6-bit scales/mins,
 * 128 bytes of nibbles; ...). */
#ifndef M40_QUANT_H
#define M40_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "ggml_types.h"

float m40_fp16_to_fp32(uint16_t h);
uint16_t m40_fp32_to_fp16(float f);   /* round to nearest even */
float m40_bf16_to_fp32(uint16_t h);
uint16_t m40_fp32_to_bf16(float f);   /* round to nearest even */

/* 1 when m40_dequantize_row / m40_dot_row handle this type. */
int m40_type_supported(uint32_t type);

/* Dequantize n elements (n a multiple of the type's block size) starting at src. */
void m40_dequantize_row(uint32_t type, const void *src, float *dst, int64_t n);

/* dot(row of n elements of `type` at src, x[0..n)) in float (accumulated in float/double
 * per block). n a multiple of the block size. */
float m40_dot_row(uint32_t type, const void *src, const float *x, int64_t n);

/* Quantize n floats into `type` (reference quantizers: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
 * Q6_K, MXFP4). Returns 0, or -1 for a type without a quantizer. Used by `m40 mkmodel`
 * and by tests. */
int m40_quantize_row(uint32_t type, const float *src, void *dst, int64_t n);
/* The same, with the K-quants' (Q4_K, Q6_K) sub-block scales fitted by least squares at
 * one candidate step (from the block's range) instead of 13 or 17: several times faster
 * and a little less accurate (tests/unit/test_quant.c bounds it). Other types are
 * quantized exactly as by m40_quantize_row. For `m40 mkmodel --quick`: random weights of
 * large shapes for speed benchmarks, where the values do not matter. */
int m40_quantize_row_quick(uint32_t type, const float *src, void *dst, int64_t n);

#endif
