/* ggml tensor element types as stored in GGUF files, with their block layout.
 * Numbering follows the GGUF specification so that file values map directly. */
#ifndef M40_GGML_TYPES_H
#define M40_GGML_TYPES_H

#include <stddef.h>
#include <stdint.h>

enum m40_type {
    M40_TYPE_F32 = 0,
    M40_TYPE_F16 = 1,
    M40_TYPE_Q4_0 = 2,
    M40_TYPE_Q4_1 = 3,
    M40_TYPE_Q5_0 = 6,
    M40_TYPE_Q5_1 = 7,
    M40_TYPE_Q8_0 = 8,
    M40_TYPE_Q8_1 = 9,
    M40_TYPE_Q2_K = 10,
    M40_TYPE_Q3_K = 11,
    M40_TYPE_Q4_K = 12,
    M40_TYPE_Q5_K = 13,
    M40_TYPE_Q6_K = 14,
    M40_TYPE_Q8_K = 15,
    M40_TYPE_I8 = 24,
    M40_TYPE_I16 = 25,
    M40_TYPE_I32 = 26,
    M40_TYPE_I64 = 27,
    M40_TYPE_F64 = 28,
    M40_TYPE_BF16 = 30,
    M40_TYPE_MXFP4 = 39, /* OCP microscaling FP4: E8M0 scale + 32 E2M1 values (gpt-oss experts) */
    M40_TYPE_COUNT = 40
};

#define M40_QK_K 256 /* super-block size of the K-quants */

typedef struct {
    const char *name;
    uint32_t block_elems; /* elements per block (1 for plain types) */
    uint32_t block_bytes; /* bytes per block; 0 = unknown type */
} m40_type_info;

/* NULL for a type id this build does not know at all. */
const m40_type_info *m40_type_get(uint32_t type);
/* Name for messages; "type<N>" style text for unknown ids (static buffer per call site is not used:
 * unknown ids return "unknown"). */
const char *m40_type_name(uint32_t type);
/* 1 when the CPU backend can dequantize / multiply this type. */
int m40_type_supported(uint32_t type);
/* Bytes for n elements of this type. Returns -1 when n is not a multiple of the block size,
 * the type is unknown, or the size overflows. */
int m40_type_nbytes(uint32_t type, uint64_t n, uint64_t *out);

#endif
