/* GGUF v2/v3 reader: the whole file is mmap'd read-only; metadata is parsed and
 * validated up front (every count, length and offset bounds-checked), tensor data
 * is referenced in place. Nothing here trusts the file. */
#ifndef M40_GGUF_H
#define M40_GGUF_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    M40_GGUF_UINT8 = 0,
    M40_GGUF_INT8 = 1,
    M40_GGUF_UINT16 = 2,
    M40_GGUF_INT16 = 3,
    M40_GGUF_UINT32 = 4,
    M40_GGUF_INT32 = 5,
    M40_GGUF_FLOAT32 = 6,
    M40_GGUF_BOOL = 7,
    M40_GGUF_STRING = 8,
    M40_GGUF_ARRAY = 9,
    M40_GGUF_UINT64 = 10,
    M40_GGUF_INT64 = 11,
    M40_GGUF_FLOAT64 = 12,
} m40_gguf_type;

/* One metadata value. Scalars are widened: unsigned types into u64, signed into i64,
 * floats into f64, bool into b. Strings are NUL-terminated copies owned by the
 * m40_gguf (len excludes the NUL; a string may itself contain NUL bytes). Arrays hold
 * n items of one element type, each item a full m40_gguf_value (nested arrays allowed). */
typedef struct m40_gguf_value {
    m40_gguf_type type;
    union {
        uint64_t u64;
        int64_t i64;
        double f64;
        int b;
        struct {
            const char *ptr;
            uint64_t len;
        } str;
        struct {
            m40_gguf_type type;
            uint64_t n;
            const struct m40_gguf_value *items;
        } arr;
    } v;
} m40_gguf_value;

typedef struct {
    const char *key; /* NUL-terminated copy */
    m40_gguf_value value;
} m40_gguf_kv;

#define M40_GGUF_MAX_DIMS 4

typedef struct {
    const char *name;      /* NUL-terminated copy */
    uint32_t type;         /* enum m40_type (ggml_types.h) */
    uint32_t n_dims;       /* 1..4 */
    uint64_t ne[M40_GGUF_MAX_DIMS]; /* ne[0] is the contiguous dimension (row length); unused dims are 1 */
    uint64_t n_elems;
    uint64_t offset;       /* relative to the start of the data section */
    uint64_t nbytes;
    const void *data;      /* points into the mapping; aligned to general.alignment */
} m40_gguf_tensor;

typedef struct m40_gguf m40_gguf;

/* Open and validate. On failure returns -1, *out is NULL and err holds a message naming
 * the problem (e.g. "truncated file: tensor info 3 name length at offset 1234"). */
int m40_gguf_open(const char *path, m40_gguf **out, char *err, size_t errlen);
/* Same over a caller-owned buffer (not copied; must outlive the handle). Used by tests. */
int m40_gguf_open_mem(const void *data, size_t size, m40_gguf **out, char *err, size_t errlen);
void m40_gguf_close(m40_gguf *g);

uint32_t m40_gguf_version(const m40_gguf *g);
uint64_t m40_gguf_alignment(const m40_gguf *g);
uint64_t m40_gguf_data_offset(const m40_gguf *g);
uint64_t m40_gguf_file_size(const m40_gguf *g);

uint64_t m40_gguf_n_kv(const m40_gguf *g);
const m40_gguf_kv *m40_gguf_kv_at(const m40_gguf *g, uint64_t i);
/* NULL when absent. */
const m40_gguf_value *m40_gguf_get(const m40_gguf *g, const char *key);

/* Typed getters: return 0 on success, -1 when absent or of an incompatible type/range.
 * get_u32/get_i64 accept any integer type whose value fits; get_f32 accepts float and
 * integer types; get_str returns the NUL-terminated string or NULL. */
int m40_gguf_get_u32(const m40_gguf *g, const char *key, uint32_t *out);
int m40_gguf_get_i64(const m40_gguf *g, const char *key, int64_t *out);
int m40_gguf_get_f32(const m40_gguf *g, const char *key, float *out);
int m40_gguf_get_bool(const m40_gguf *g, const char *key, int *out);
const char *m40_gguf_get_str(const m40_gguf *g, const char *key);
/* Array of the given element type, or NULL (absent, not an array, other element type). */
const m40_gguf_value *m40_gguf_get_arr(const m40_gguf *g, const char *key, m40_gguf_type elem_type);

/* Architecture-prefixed lookups: m40_gguf_get_arch_u32(g, "block_count", &v) reads
 * "<general.architecture>.block_count". */
int m40_gguf_get_arch_u32(const m40_gguf *g, const char *suffix, uint32_t *out);
int m40_gguf_get_arch_f32(const m40_gguf *g, const char *suffix, float *out);
const char *m40_gguf_arch(const m40_gguf *g); /* general.architecture or NULL */

uint64_t m40_gguf_n_tensors(const m40_gguf *g);
const m40_gguf_tensor *m40_gguf_tensor_at(const m40_gguf *g, uint64_t i);
const m40_gguf_tensor *m40_gguf_find_tensor(const m40_gguf *g, const char *name);

const char *m40_gguf_type_name(m40_gguf_type t); /* "uint32", "string", ... */

#endif
