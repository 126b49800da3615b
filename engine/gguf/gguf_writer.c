/* GGUF v3 writer. Metadata is serialized into a byte buffer as it is set (the kv
 * section never changes afterwards); tensors are kept until write time, when the
 * layout (info offsets, alignment padding) is computed once for both outputs. */
#include "gguf_writer.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref/ggml_types.h"

#define WRITER_DEFAULT_ALIGNMENT 32

typedef struct {
    char *name;
    uint32_t type;
    uint32_t n_dims;
    uint64_t ne[M40_GGUF_MAX_DIMS];
    unsigned char *data; /* NULL: zeros */
    uint64_t nbytes;
} writer_tensor;

struct m40_gguf_writer {
    unsigned char *kv; /* serialized kv section */
    size_t kv_len, kv_cap;
    uint64_t n_kv;
    char **keys; /* for duplicate detection */
    size_t keys_cap;
    writer_tensor *tensors;
    uint64_t n_tensors;
    size_t tensors_cap;
    uint64_t alignment;
    char err[512];
};

static int werr(m40_gguf_writer *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int werr(m40_gguf_writer *w, const char *fmt, ...)
{
    if (!w->err[0]) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(w->err, sizeof w->err, fmt, ap);
        va_end(ap);
        if (!w->err[0])
            snprintf(w->err, sizeof w->err, "writer error");
    }
    return -1;
}

m40_gguf_writer *m40_gguf_writer_new(void)
{
    m40_gguf_writer *w = calloc(1, sizeof *w);
    if (w)
        w->alignment = WRITER_DEFAULT_ALIGNMENT;
    return w;
}

void m40_gguf_writer_free(m40_gguf_writer *w)
{
    if (!w)
        return;
    for (uint64_t i = 0; i < w->n_kv; i++)
        free(w->keys[i]);
    free(w->keys);
    for (uint64_t i = 0; i < w->n_tensors; i++) {
        free(w->tensors[i].name);
        free(w->tensors[i].data);
    }
    free(w->tensors);
    free(w->kv);
    free(w);
}

const char *m40_gguf_writer_error(const m40_gguf_writer *w)
{
    return w->err[0] ? w->err : NULL;
}

/* ---------- kv serialization ---------- */

/* Appends to the kv buffer; a failed append sets *failed and is otherwise ignored so
 * that callers check once at the end of a value. */
static void put(m40_gguf_writer *w, const void *p, size_t n, int *failed)
{
    if (*failed)
        return;
    if (n > w->kv_cap - w->kv_len) {
        size_t cap = w->kv_cap ? w->kv_cap : 256;
        while (cap - w->kv_len < n) {
            if (cap > SIZE_MAX / 2) {
                *failed = 1;
                return;
            }
            cap *= 2;
        }
        unsigned char *nb = realloc(w->kv, cap);
        if (!nb) {
            *failed = 1;
            return;
        }
        w->kv = nb;
        w->kv_cap = cap;
    }
    memcpy(w->kv + w->kv_len, p, n);
    w->kv_len += n;
}

/* little-endian, independent of the host */
static void put_le(m40_gguf_writer *w, uint64_t v, size_t n, int *failed)
{
    unsigned char b[8];
    for (size_t i = 0; i < n; i++)
        b[i] = (unsigned char)(v >> (8 * i));
    put(w, b, n, failed);
}

static void put_string(m40_gguf_writer *w, const char *s, uint64_t len, int *failed)
{
    put_le(w, len, 8, failed);
    put(w, s, (size_t)len, failed);
}

/* Starts a kv: checks the key, writes it; returns the buffer length to roll back to. */
static int begin_kv(m40_gguf_writer *w, const char *key, size_t *mark)
{
    if (!key)
        return werr(w, "kv key is NULL");
    for (uint64_t i = 0; i < w->n_kv; i++)
        if (!strcmp(w->keys[i], key))
            return werr(w, "duplicate key '%s'", key);
    if (w->n_kv == w->keys_cap) {
        size_t cap = w->keys_cap ? w->keys_cap * 2 : 16;
        char **nk = realloc(w->keys, cap * sizeof *nk);
        if (!nk)
            return werr(w, "out of memory adding key '%s'", key);
        w->keys = nk;
        w->keys_cap = cap;
    }
    *mark = w->kv_len;
    int failed = 0;
    put_string(w, key, strlen(key), &failed);
    if (failed)
        return werr(w, "out of memory adding key '%s'", key);
    return 0;
}

static int end_kv(m40_gguf_writer *w, const char *key, size_t mark, int failed)
{
    char *k = failed ? NULL : strdup(key);
    if (!k) {
        w->kv_len = mark;
        return werr(w, "out of memory adding key '%s'", key);
    }
    w->keys[w->n_kv++] = k;
    return 0;
}

static int scalar_size(m40_gguf_type t)
{
    switch (t) {
    case M40_GGUF_UINT8: case M40_GGUF_INT8: case M40_GGUF_BOOL: return 1;
    case M40_GGUF_UINT16: case M40_GGUF_INT16: return 2;
    case M40_GGUF_UINT32: case M40_GGUF_INT32: case M40_GGUF_FLOAT32: return 4;
    case M40_GGUF_UINT64: case M40_GGUF_INT64: case M40_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

/* payload of one scalar from a widened m40_gguf_value */
static void put_scalar_value(m40_gguf_writer *w, const m40_gguf_value *v, int *failed)
{
    int n = scalar_size(v->type);
    if (v->type == M40_GGUF_FLOAT32) {
        float f = (float)v->v.f64;
        uint32_t x;
        memcpy(&x, &f, 4);
        put_le(w, x, 4, failed);
    } else if (v->type == M40_GGUF_FLOAT64) {
        uint64_t x;
        memcpy(&x, &v->v.f64, 8);
        put_le(w, x, 8, failed);
    } else if (v->type == M40_GGUF_BOOL) {
        put_le(w, v->v.b ? 1 : 0, 1, failed);
    } else {
        /* signed values were sign-extended into i64; the low n bytes are the encoding */
        put_le(w, v->v.u64, (size_t)n, failed);
    }
}

/* payload (no type tag) of v; the tag is written by the caller */
static int put_value(m40_gguf_writer *w, const char *key, const m40_gguf_value *v, int *failed)
{
    if (scalar_size(v->type)) {
        put_scalar_value(w, v, failed);
        return 0;
    }
    if (v->type == M40_GGUF_STRING) {
        if (!v->v.str.ptr && v->v.str.len)
            return werr(w, "key '%s': string with NULL data", key);
        put_string(w, v->v.str.ptr ? v->v.str.ptr : "", v->v.str.len, failed);
        return 0;
    }
    if (v->type == M40_GGUF_ARRAY) {
        if (!scalar_size(v->v.arr.type) && v->v.arr.type != M40_GGUF_STRING && v->v.arr.type != M40_GGUF_ARRAY)
            return werr(w, "key '%s': unknown array element type %d", key, (int)v->v.arr.type);
        if (v->v.arr.n && !v->v.arr.items)
            return werr(w, "key '%s': array of %llu items with NULL items", key, (unsigned long long)v->v.arr.n);
        put_le(w, (uint32_t)v->v.arr.type, 4, failed);
        put_le(w, v->v.arr.n, 8, failed);
        for (uint64_t i = 0; i < v->v.arr.n && !*failed; i++) {
            if (v->v.arr.items[i].type != v->v.arr.type)
                return werr(w, "key '%s': array item %llu has type %s, the array holds %s", key,
                            (unsigned long long)i, m40_gguf_type_name(v->v.arr.items[i].type),
                            m40_gguf_type_name(v->v.arr.type));
            if (put_value(w, key, &v->v.arr.items[i], failed))
                return -1;
        }
        return 0;
    }
    return werr(w, "key '%s': unknown value type %d", key, (int)v->type);
}

int m40_gguf_writer_set_value(m40_gguf_writer *w, const char *key, const m40_gguf_value *v)
{
    size_t mark;
    if (!v)
        return werr(w, "key '%s': NULL value", key ? key : "(null)");
    if (begin_kv(w, key, &mark))
        return -1;
    int failed = 0;
    put_le(w, (uint32_t)v->type, 4, &failed);
    if (put_value(w, key, v, &failed)) {
        w->kv_len = mark;
        return -1;
    }
    if (end_kv(w, key, mark, failed))
        return -1;
    /* the writer lays out data with the alignment the file declares, when usable */
    if (!strcmp(key, "general.alignment") && scalar_size(v->type) && v->type != M40_GGUF_FLOAT32 &&
        v->type != M40_GGUF_FLOAT64 && v->type != M40_GGUF_BOOL) {
        uint64_t a = v->v.u64;
        int neg = (v->type == M40_GGUF_INT8 || v->type == M40_GGUF_INT16 || v->type == M40_GGUF_INT32 ||
                   v->type == M40_GGUF_INT64) && v->v.i64 < 0;
        if (!neg && a && !(a & (a - 1)) && a <= ((uint64_t)1 << 30))
            w->alignment = a;
    }
    return 0;
}

static int set_u(m40_gguf_writer *w, const char *key, m40_gguf_type t, uint64_t x)
{
    m40_gguf_value v = {.type = t};
    v.v.u64 = x;
    return m40_gguf_writer_set_value(w, key, &v);
}

static int set_i(m40_gguf_writer *w, const char *key, m40_gguf_type t, int64_t x)
{
    m40_gguf_value v = {.type = t};
    v.v.i64 = x;
    return m40_gguf_writer_set_value(w, key, &v);
}

int m40_gguf_writer_set_u8(m40_gguf_writer *w, const char *key, uint8_t v) { return set_u(w, key, M40_GGUF_UINT8, v); }
int m40_gguf_writer_set_u16(m40_gguf_writer *w, const char *key, uint16_t v) { return set_u(w, key, M40_GGUF_UINT16, v); }
int m40_gguf_writer_set_u32(m40_gguf_writer *w, const char *key, uint32_t v) { return set_u(w, key, M40_GGUF_UINT32, v); }
int m40_gguf_writer_set_u64(m40_gguf_writer *w, const char *key, uint64_t v) { return set_u(w, key, M40_GGUF_UINT64, v); }
int m40_gguf_writer_set_i8(m40_gguf_writer *w, const char *key, int8_t v) { return set_i(w, key, M40_GGUF_INT8, v); }
int m40_gguf_writer_set_i16(m40_gguf_writer *w, const char *key, int16_t v) { return set_i(w, key, M40_GGUF_INT16, v); }
int m40_gguf_writer_set_i32(m40_gguf_writer *w, const char *key, int32_t v) { return set_i(w, key, M40_GGUF_INT32, v); }
int m40_gguf_writer_set_i64(m40_gguf_writer *w, const char *key, int64_t v) { return set_i(w, key, M40_GGUF_INT64, v); }

int m40_gguf_writer_set_f32(m40_gguf_writer *w, const char *key, float x)
{
    m40_gguf_value v = {.type = M40_GGUF_FLOAT32};
    v.v.f64 = x;
    return m40_gguf_writer_set_value(w, key, &v);
}

int m40_gguf_writer_set_f64(m40_gguf_writer *w, const char *key, double x)
{
    m40_gguf_value v = {.type = M40_GGUF_FLOAT64};
    v.v.f64 = x;
    return m40_gguf_writer_set_value(w, key, &v);
}

int m40_gguf_writer_set_bool(m40_gguf_writer *w, const char *key, int x)
{
    m40_gguf_value v = {.type = M40_GGUF_BOOL};
    v.v.b = x ? 1 : 0;
    return m40_gguf_writer_set_value(w, key, &v);
}

int m40_gguf_writer_set_str_n(m40_gguf_writer *w, const char *key, const char *s, size_t len)
{
    m40_gguf_value v = {.type = M40_GGUF_STRING};
    v.v.str.ptr = s;
    v.v.str.len = len;
    return m40_gguf_writer_set_value(w, key, &v);
}

int m40_gguf_writer_set_str(m40_gguf_writer *w, const char *key, const char *s)
{
    if (!s)
        return werr(w, "key '%s': NULL string", key ? key : "(null)");
    return m40_gguf_writer_set_str_n(w, key, s, strlen(s));
}

/* Arrays are written straight into the kv buffer rather than through a value tree, so
 * a 262k-entry vocabulary costs no temporary per-item structures. */
int m40_gguf_writer_set_arr(m40_gguf_writer *w, const char *key, m40_gguf_type elem_type, const void *items,
                            uint64_t n)
{
    size_t mark;
    int sz = scalar_size(elem_type);
    if (!sz)
        return werr(w, "key '%s': set_arr takes scalar element types, not %s", key ? key : "(null)",
                    m40_gguf_type_name(elem_type));
    if (n && !items)
        return werr(w, "key '%s': NULL items", key ? key : "(null)");
    if (begin_kv(w, key, &mark))
        return -1;
    int failed = 0;
    put_le(w, M40_GGUF_ARRAY, 4, &failed);
    put_le(w, (uint32_t)elem_type, 4, &failed);
    put_le(w, n, 8, &failed);
    const unsigned char *p = items;
    for (uint64_t i = 0; i < n && !failed; i++, p += sz) {
        uint64_t x = 0;
        /* items are host-order C values; re-encode as little-endian */
        switch (sz) {
        case 1: { uint8_t t; memcpy(&t, p, 1); x = elem_type == M40_GGUF_BOOL ? (t != 0) : t; break; }
        case 2: { uint16_t t; memcpy(&t, p, 2); x = t; break; }
        case 4: { uint32_t t; memcpy(&t, p, 4); x = t; break; }
        default: memcpy(&x, p, 8); break;
        }
        put_le(w, x, (size_t)sz, &failed);
    }
    return end_kv(w, key, mark, failed);
}

int m40_gguf_writer_set_arr_f32(m40_gguf_writer *w, const char *key, const float *v, uint64_t n)
{
    return m40_gguf_writer_set_arr(w, key, M40_GGUF_FLOAT32, v, n);
}

int m40_gguf_writer_set_arr_i32(m40_gguf_writer *w, const char *key, const int32_t *v, uint64_t n)
{
    return m40_gguf_writer_set_arr(w, key, M40_GGUF_INT32, v, n);
}

int m40_gguf_writer_set_arr_str(m40_gguf_writer *w, const char *key, const char *const *strs, uint64_t n)
{
    size_t mark;
    if (n && !strs)
        return werr(w, "key '%s': NULL string list", key ? key : "(null)");
    for (uint64_t i = 0; i < n; i++)
        if (!strs[i])
            return werr(w, "key '%s': string %llu is NULL", key ? key : "(null)", (unsigned long long)i);
    if (begin_kv(w, key, &mark))
        return -1;
    int failed = 0;
    put_le(w, M40_GGUF_ARRAY, 4, &failed);
    put_le(w, M40_GGUF_STRING, 4, &failed);
    put_le(w, n, 8, &failed);
    for (uint64_t i = 0; i < n && !failed; i++)
        put_string(w, strs[i], strlen(strs[i]), &failed);
    return end_kv(w, key, mark, failed);
}

/* ---------- tensors ---------- */

int m40_gguf_writer_add_tensor(m40_gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                               const uint64_t *ne, const void *data, uint64_t nbytes)
{
    if (!name)
        return werr(w, "tensor name is NULL");
    if (n_dims < 1 || n_dims > M40_GGUF_MAX_DIMS || !ne)
        return werr(w, "tensor '%s': n_dims %u out of range 1..%d", name, n_dims, M40_GGUF_MAX_DIMS);
    uint64_t n = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        if (ne[d] == 0 || ne[d] > (uint64_t)INT64_MAX / n)
            return werr(w, "tensor '%s': dimension %u (%llu) is zero or overflows the element count", name, d,
                        (unsigned long long)ne[d]);
        n *= ne[d];
    }
    uint64_t want;
    if (m40_type_nbytes(type, n, &want))
        return werr(w, "tensor '%s': %llu elements do not fit type %s (unknown type or not whole blocks)", name,
                    (unsigned long long)n, m40_type_name(type));
    if (nbytes != want)
        return werr(w, "tensor '%s': %llu bytes given, %llu %s elements take %llu", name, (unsigned long long)nbytes,
                    (unsigned long long)n, m40_type_name(type), (unsigned long long)want);
    if (nbytes > SIZE_MAX)
        return werr(w, "tensor '%s': %llu bytes do not fit in memory", name, (unsigned long long)nbytes);
    for (uint64_t i = 0; i < w->n_tensors; i++)
        if (!strcmp(w->tensors[i].name, name))
            return werr(w, "duplicate tensor name '%s'", name);
    if (w->n_tensors == w->tensors_cap) {
        size_t cap = w->tensors_cap ? w->tensors_cap * 2 : 16;
        writer_tensor *nt = realloc(w->tensors, cap * sizeof *nt);
        if (!nt)
            return werr(w, "out of memory adding tensor '%s'", name);
        w->tensors = nt;
        w->tensors_cap = cap;
    }
    writer_tensor t = {.type = type, .n_dims = n_dims, .nbytes = nbytes};
    for (uint32_t d = 0; d < M40_GGUF_MAX_DIMS; d++)
        t.ne[d] = d < n_dims ? ne[d] : 1;
    t.name = strdup(name);
    if (data && nbytes) {
        t.data = malloc((size_t)nbytes);
        if (t.data)
            memcpy(t.data, data, (size_t)nbytes);
    }
    if (!t.name || (data && nbytes && !t.data)) {
        free(t.name);
        free(t.data);
        return werr(w, "out of memory adding tensor '%s' (%llu bytes)", name, (unsigned long long)nbytes);
    }
    w->tensors[w->n_tensors++] = t;
    return 0;
}

/* ---------- output ---------- */

typedef struct {
    FILE *f;
    unsigned char *buf;
    size_t len;
    int failed;
} sink;

static void emit(sink *s, const void *p, size_t n)
{
    if (s->failed || !n)
        return;
    if (s->f) {
        if (fwrite(p, 1, n, s->f) != n)
            s->failed = 1;
    } else {
        if (p)
            memcpy(s->buf + s->len, p, n);
        else
            memset(s->buf + s->len, 0, n);
    }
    s->len += n;
}

static void emit_zeros(sink *s, uint64_t n)
{
    static const unsigned char zeros[4096];
    while (n) {
        size_t k = n < sizeof zeros ? (size_t)n : sizeof zeros;
        emit(s, zeros, k);
        n -= k;
    }
}

static void emit_le(sink *s, uint64_t v, size_t n)
{
    unsigned char b[8];
    for (size_t i = 0; i < n; i++)
        b[i] = (unsigned char)(v >> (8 * i));
    emit(s, b, n);
}

static uint64_t pad_to(uint64_t x, uint64_t a)
{
    return (a - x % a) % a;
}

/* Total file size; tensor offsets follow from the same walk in write_all. */
static int layout(m40_gguf_writer *w, uint64_t *total)
{
    uint64_t pos = 4 + 4 + 8 + 8 + w->kv_len;
    for (uint64_t i = 0; i < w->n_tensors; i++)
        pos += 8 + strlen(w->tensors[i].name) + 4 + 8 * (uint64_t)w->tensors[i].n_dims + 4 + 8;
    pos += pad_to(pos, w->alignment);
    for (uint64_t i = 0; i < w->n_tensors; i++) {
        uint64_t n = w->tensors[i].nbytes + pad_to(w->tensors[i].nbytes, w->alignment);
        if (n > UINT64_MAX - pos)
            return werr(w, "file size overflows");
        pos += n;
    }
    *total = pos;
    return 0;
}

static void write_all(m40_gguf_writer *w, sink *s)
{
    emit(s, "GGUF", 4);
    emit_le(s, 3, 4);
    emit_le(s, w->n_tensors, 8);
    emit_le(s, w->n_kv, 8);
    emit(s, w->kv, w->kv_len);
    uint64_t off = 0;
    for (uint64_t i = 0; i < w->n_tensors; i++) {
        const writer_tensor *t = &w->tensors[i];
        size_t nl = strlen(t->name);
        emit_le(s, nl, 8);
        emit(s, t->name, nl);
        emit_le(s, t->n_dims, 4);
        for (uint32_t d = 0; d < t->n_dims; d++)
            emit_le(s, t->ne[d], 8);
        emit_le(s, t->type, 4);
        emit_le(s, off, 8);
        off += t->nbytes + pad_to(t->nbytes, w->alignment);
    }
    emit_zeros(s, pad_to(s->len, w->alignment));
    for (uint64_t i = 0; i < w->n_tensors; i++) {
        const writer_tensor *t = &w->tensors[i];
        if (t->data)
            emit(s, t->data, (size_t)t->nbytes);
        else
            emit_zeros(s, t->nbytes);
        emit_zeros(s, pad_to(t->nbytes, w->alignment));
    }
}

int m40_gguf_writer_write_mem(m40_gguf_writer *w, void **out, size_t *size, char *err, size_t errlen)
{
    uint64_t total;
    *out = NULL;
    *size = 0;
    if (w->err[0] || layout(w, &total)) {
        snprintf(err, errlen, "%s", w->err);
        return -1;
    }
    if (total > SIZE_MAX) {
        snprintf(err, errlen, "file of %llu bytes does not fit in memory", (unsigned long long)total);
        return -1;
    }
    sink s = {.buf = malloc((size_t)total)};
    if (!s.buf) {
        snprintf(err, errlen, "out of memory for a %llu-byte GGUF buffer", (unsigned long long)total);
        return -1;
    }
    write_all(w, &s);
    if (s.len != total) { /* layout and write_all must agree; a mismatch is a bug here */
        free(s.buf);
        snprintf(err, errlen, "internal error: wrote %zu bytes, layout said %llu", s.len, (unsigned long long)total);
        return -1;
    }
    *out = s.buf;
    *size = s.len;
    return 0;
}

int m40_gguf_writer_write_file(m40_gguf_writer *w, const char *path, char *err, size_t errlen)
{
    uint64_t total;
    if (w->err[0] || layout(w, &total)) {
        snprintf(err, errlen, "%s", w->err);
        return -1;
    }
    FILE *f = fopen(path, "wb");
    if (!f) {
        snprintf(err, errlen, "cannot create %s: %s", path, strerror(errno));
        return -1;
    }
    sink s = {.f = f};
    write_all(w, &s);
    int werrno = errno;
    if (fclose(f) != 0 && !s.failed) {
        s.failed = 1;
        werrno = errno;
    }
    if (s.failed) {
        snprintf(err, errlen, "cannot write %s: %s", path, strerror(werrno));
        remove(path);
        return -1;
    }
    return 0;
}
