#include "ggml_types.h"

static const m40_type_info type_table[M40_TYPE_COUNT] = {
    [M40_TYPE_F32] = {"F32", 1, 4},
    [M40_TYPE_F16] = {"F16", 1, 2},
    [M40_TYPE_Q4_0] = {"Q4_0", 32, 18},
    [M40_TYPE_Q4_1] = {"Q4_1", 32, 20},
    [M40_TYPE_Q5_0] = {"Q5_0", 32, 22},
    [M40_TYPE_Q5_1] = {"Q5_1", 32, 24},
    [M40_TYPE_Q8_0] = {"Q8_0", 32, 34},
    [M40_TYPE_Q8_1] = {"Q8_1", 32, 36},
    [M40_TYPE_Q2_K] = {"Q2_K", M40_QK_K, 84},
    [M40_TYPE_Q3_K] = {"Q3_K", M40_QK_K, 110},
    [M40_TYPE_Q4_K] = {"Q4_K", M40_QK_K, 144},
    [M40_TYPE_Q5_K] = {"Q5_K", M40_QK_K, 176},
    [M40_TYPE_Q6_K] = {"Q6_K", M40_QK_K, 210},
    [M40_TYPE_Q8_K] = {"Q8_K", M40_QK_K, 292},
    [M40_TYPE_I8] = {"I8", 1, 1},
    [M40_TYPE_I16] = {"I16", 1, 2},
    [M40_TYPE_I32] = {"I32", 1, 4},
    [M40_TYPE_I64] = {"I64", 1, 8},
    [M40_TYPE_F64] = {"F64", 1, 8},
    [M40_TYPE_BF16] = {"BF16", 1, 2},
    [M40_TYPE_MXFP4] = {"MXFP4", 32, 17},
};

const m40_type_info *m40_type_get(uint32_t type)
{
    if (type >= M40_TYPE_COUNT || type_table[type].block_bytes == 0)
        return NULL;
    return &type_table[type];
}

const char *m40_type_name(uint32_t type)
{
    const m40_type_info *ti = m40_type_get(type);
    return ti ? ti->name : "unknown";
}

int m40_type_nbytes(uint32_t type, uint64_t n, uint64_t *out)
{
    const m40_type_info *ti = m40_type_get(type);
    if (!ti || n % ti->block_elems != 0)
        return -1;
    uint64_t blocks = n / ti->block_elems;
    if (blocks > UINT64_MAX / ti->block_bytes)
        return -1;
    *out = blocks * ti->block_bytes;
    return 0;
}
