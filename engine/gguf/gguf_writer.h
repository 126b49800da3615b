/* Small GGUF v3 writer: collect metadata and tensors in memory, then write them to a
 * file or a malloc'd buffer. Used by the tests (to build valid files and corrupt
 * them) and by `m40 mkmodel`.
 *
 * Errors are sticky: the first failing call records a message (m40_gguf_writer_error)
 * and returns -1; later setters still work, but write_* refuses to write and reports
 * that first message. Keys and tensor names must be unique.
 *
 * Layout: general.alignment, when set to a non-zero power of two, is used for the data
 * section; any other value is written as given (so that tests can build files a reader
 * must reject) while the layout keeps the default alignment of 32. */
#ifndef M40_GGUF_WRITER_H
#define M40_GGUF_WRITER_H

#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

typedef struct m40_gguf_writer m40_gguf_writer;

m40_gguf_writer *m40_gguf_writer_new(void); /* NULL when out of memory */
void m40_gguf_writer_free(m40_gguf_writer *w);
/* First error recorded, or NULL. */
const char *m40_gguf_writer_error(const m40_gguf_writer *w);

int m40_gguf_writer_set_u8(m40_gguf_writer *w, const char *key, uint8_t v);
int m40_gguf_writer_set_i8(m40_gguf_writer *w, const char *key, int8_t v);
int m40_gguf_writer_set_u16(m40_gguf_writer *w, const char *key, uint16_t v);
int m40_gguf_writer_set_i16(m40_gguf_writer *w, const char *key, int16_t v);
int m40_gguf_writer_set_u32(m40_gguf_writer *w, const char *key, uint32_t v);
int m40_gguf_writer_set_i32(m40_gguf_writer *w, const char *key, int32_t v);
int m40_gguf_writer_set_u64(m40_gguf_writer *w, const char *key, uint64_t v);
int m40_gguf_writer_set_i64(m40_gguf_writer *w, const char *key, int64_t v);
int m40_gguf_writer_set_f32(m40_gguf_writer *w, const char *key, float v);
int m40_gguf_writer_set_f64(m40_gguf_writer *w, const char *key, double v);
int m40_gguf_writer_set_bool(m40_gguf_writer *w, const char *key, int v);
int m40_gguf_writer_set_str(m40_gguf_writer *w, const char *key, const char *s);
/* A string of len bytes that may contain NUL bytes. */
int m40_gguf_writer_set_str_n(m40_gguf_writer *w, const char *key, const char *s, size_t len);

/* Array of n scalars; items points at n C values of the matching fixed-width type
 * (uint8_t for UINT8, int16_t for INT16, float for FLOAT32, double for FLOAT64, and
 * uint8_t holding 0 or 1 for BOOL). STRING and ARRAY elements go through
 * set_arr_str / set_value. */
int m40_gguf_writer_set_arr(m40_gguf_writer *w, const char *key, m40_gguf_type elem_type, const void *items,
                            uint64_t n);
int m40_gguf_writer_set_arr_str(m40_gguf_writer *w, const char *key, const char *const *strs, uint64_t n);
int m40_gguf_writer_set_arr_f32(m40_gguf_writer *w, const char *key, const float *v, uint64_t n);
int m40_gguf_writer_set_arr_i32(m40_gguf_writer *w, const char *key, const int32_t *v, uint64_t n);
/* Any value tree, nested arrays included (the reader's own m40_gguf_value, so a kv read
 * from one file can be copied into another). Every array item must have the array's
 * element type; nesting depth is not limited here (the reader limits it). */
int m40_gguf_writer_set_value(m40_gguf_writer *w, const char *key, const m40_gguf_value *v);

/* Adds a tensor; data (nbytes, copied) may be NULL for zeros. ne[0] is the row length,
 * nbytes must equal the size of the ne product in this type. */
int m40_gguf_writer_add_tensor(m40_gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                               const uint64_t *ne, const void *data, uint64_t nbytes);

/* The whole file in one malloc'd buffer (caller frees). */
int m40_gguf_writer_write_mem(m40_gguf_writer *w, void **out, size_t *size, char *err, size_t errlen);
int m40_gguf_writer_write_file(m40_gguf_writer *w, const char *path, char *err, size_t errlen);

#endif
