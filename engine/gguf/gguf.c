/* GGUF v2/v3 reader. The file is mapped read-only and parsed in one pass; every
 * count, length and offset is checked against the bytes that remain before it is
 * used, so a hostile file fails with a message instead of reading out of bounds or
 * asking for absurd allocations. Strings and array items live in one arena per
 * handle: a 262k-token vocabulary costs one item allocation plus a few arena chunks,
 * not 262k mallocs. */
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ref/ggml_types.h"
#include "util/hash.h"

#define GGUF_DEFAULT_ALIGNMENT 32
/* Real files nest at most 2 deep; the bound keeps a hostile file from recursing the
 * stack away. */
#define GGUF_MAX_NESTING 8
#define ARENA_CHUNK ((size_t)1 << 16)

/* ---------- arena: strings and value items, freed all at once ---------- */

typedef struct arena_block {
    struct arena_block *next;
    size_t cap;
    size_t used;
} arena_block;

#define ARENA_HDR ((sizeof(arena_block) + 15) & ~(size_t)15)

typedef struct {
    arena_block *head;
} arena;

static void *arena_alloc(arena *a, size_t n, size_t align)
{
    arena_block *b = a->head;
    if (b) {
        size_t at = (b->used + align - 1) & ~(align - 1);
        if (at <= b->cap && b->cap - at >= n) {
            b->used = at + n;
            return (unsigned char *)b + ARENA_HDR + at;
        }
    }
    if (n > SIZE_MAX - ARENA_HDR - ARENA_CHUNK)
        return NULL;
    /* Large requests get their own block, linked behind the head so that the head's
     * free space stays usable for the small strings that follow. */
    int dedicated = n > ARENA_CHUNK / 4;
    size_t cap = dedicated ? n : ARENA_CHUNK;
    arena_block *nb = malloc(ARENA_HDR + cap);
    if (!nb)
        return NULL;
    nb->cap = cap;
    nb->used = n;
    if (dedicated && a->head) {
        nb->next = a->head->next;
        a->head->next = nb;
    } else {
        nb->next = a->head;
        a->head = nb;
    }
    return (unsigned char *)nb + ARENA_HDR;
}

static void arena_free(arena *a)
{
    arena_block *b = a->head;
    while (b) {
        arena_block *n = b->next;
        free(b);
        b = n;
    }
    a->head = NULL;
}

/* ---------- name -> index hash tables ---------- */

typedef struct {
    uint64_t *slots; /* index + 1; 0 = empty */
    size_t mask;
} name_index;

static uint64_t hash_name(const char *s) { return m40_fnv1a64(s, strlen(s)); }

static int name_index_init(name_index *ix, uint64_t n)
{
    size_t cap = 16;
    while (cap < n * 2) /* n is bounded by the file size, so this cannot overflow */
        cap <<= 1;
    ix->slots = calloc(cap, sizeof *ix->slots);
    ix->mask = cap - 1;
    return ix->slots ? 0 : -1;
}

/* Looks name up; names[i] gives the name of entry i. Returns the slot where it is or
 * where it would go; *found is the index or UINT64_MAX. */
static size_t name_index_find(const name_index *ix, const char *name, const char *(*name_of)(const void *, uint64_t),
                              const void *ctx, uint64_t *found)
{
    size_t s = hash_name(name) & ix->mask;
    while (ix->slots[s]) {
        uint64_t i = ix->slots[s] - 1;
        if (!strcmp(name_of(ctx, i), name)) {
            *found = i;
            return s;
        }
        s = (s + 1) & ix->mask;
    }
    *found = UINT64_MAX;
    return s;
}

/* ---------- the handle ---------- */

struct m40_gguf {
    const uint8_t *base;
    size_t size;
    void *map; /* non-NULL when we mapped the file ourselves */
    size_t map_size;
    uint32_t version;
    uint64_t alignment;
    uint64_t data_offset;
    uint64_t n_kv;
    m40_gguf_kv *kvs;
    uint64_t n_tensors;
    m40_gguf_tensor *tensors;
    name_index kv_index;
    name_index tensor_index;
    arena arena;
};

static const char *kv_name_of(const void *ctx, uint64_t i)
{
    return ((const m40_gguf *)ctx)->kvs[i].key;
}

static const char *tensor_name_of(const void *ctx, uint64_t i)
{
    return ((const m40_gguf *)ctx)->tensors[i].name;
}

/* ---------- parser ---------- */

typedef struct {
    m40_gguf *g;
    const uint8_t *p;
    size_t size;
    size_t pos;
    char *err;
    size_t errlen;
    /* where we are, for messages: kv index and key, and the item index at each
     * array nesting level; or the tensor info index and name */
    int in_tensors;
    uint64_t index;
    const char *name;
    int depth;
    uint64_t item[GGUF_MAX_NESTING + 1];
} parser;

static void where(const parser *ps, char *buf, size_t cap)
{
    int n;
    if (ps->in_tensors)
        n = ps->name ? snprintf(buf, cap, "tensor info %llu ('%s')", (unsigned long long)ps->index, ps->name)
                     : snprintf(buf, cap, "tensor info %llu", (unsigned long long)ps->index);
    else
        n = ps->name ? snprintf(buf, cap, "kv %llu ('%s')", (unsigned long long)ps->index, ps->name)
                     : snprintf(buf, cap, "kv %llu", (unsigned long long)ps->index);
    for (int d = 0; d < ps->depth && n >= 0 && (size_t)n < cap; d++)
        n += snprintf(buf + n, cap - n, " array item %llu", (unsigned long long)ps->item[d]);
}

static int fail(parser *ps, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(parser *ps, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (ps->err && ps->errlen)
        vsnprintf(ps->err, ps->errlen, fmt, ap);
    va_end(ap);
    return -1;
}

/* "truncated file: <where> <what> at offset N" */
static int fail_truncated(parser *ps, const char *what)
{
    char w[256];
    where(ps, w, sizeof w);
    return fail(ps, "truncated file: %s %s at offset %zu (file size %zu)", w, what, ps->pos, ps->size);
}

static size_t remaining(const parser *ps)
{
    return ps->size - ps->pos;
}

static int rd_bytes(parser *ps, void *out, size_t n, const char *what)
{
    if (n > remaining(ps))
        return fail_truncated(ps, what);
    memcpy(out, ps->p + ps->pos, n);
    ps->pos += n;
    return 0;
}

/* GGUF is little-endian; assemble values bytewise so that the host order and the
 * alignment of the mapping do not matter. */
static int rd_u32(parser *ps, uint32_t *v, const char *what)
{
    uint8_t b[4];
    if (rd_bytes(ps, b, 4, what))
        return -1;
    *v = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
    return 0;
}

static int rd_u64(parser *ps, uint64_t *v, const char *what)
{
    uint8_t b[8];
    if (rd_bytes(ps, b, 8, what))
        return -1;
    uint64_t x = 0;
    for (int i = 7; i >= 0; i--)
        x = x << 8 | b[i];
    *v = x;
    return 0;
}

/* u64 length + bytes, copied NUL-terminated into the arena. forbid_nul: keys and
 * tensor names are looked up as C strings, so an embedded NUL would alias names. */
static int rd_string(parser *ps, const char **out, uint64_t *out_len, int forbid_nul, const char *what)
{
    char w[64];
    uint64_t len;
    snprintf(w, sizeof w, "%s length", what);
    if (rd_u64(ps, &len, w))
        return -1;
    if (len > remaining(ps)) {
        char wh[256];
        where(ps, wh, sizeof wh);
        return fail(ps, "truncated file: %s %s of %llu bytes at offset %zu, only %zu bytes left", wh, what,
                    (unsigned long long)len, ps->pos, remaining(ps));
    }
    if (forbid_nul && memchr(ps->p + ps->pos, 0, (size_t)len)) {
        char wh[256];
        where(ps, wh, sizeof wh);
        return fail(ps, "%s: %s contains a NUL byte at offset %zu", wh, what, ps->pos);
    }
    char *s = arena_alloc(&ps->g->arena, (size_t)len + 1, 1);
    if (!s)
        return fail(ps, "out of memory for a %s of %llu bytes", what, (unsigned long long)len);
    memcpy(s, ps->p + ps->pos, (size_t)len);
    s[len] = 0;
    ps->pos += (size_t)len;
    *out = s;
    if (out_len)
        *out_len = len;
    return 0;
}

/* Fewest bytes one value of this type can occupy in the file; used to reject counts
 * that the remaining bytes cannot possibly hold before allocating for them. 0 for an
 * unknown type. */
static size_t value_min_size(uint32_t t)
{
    switch (t) {
    case M40_GGUF_UINT8: case M40_GGUF_INT8: case M40_GGUF_BOOL: return 1;
    case M40_GGUF_UINT16: case M40_GGUF_INT16: return 2;
    case M40_GGUF_UINT32: case M40_GGUF_INT32: case M40_GGUF_FLOAT32: return 4;
    case M40_GGUF_UINT64: case M40_GGUF_INT64: case M40_GGUF_FLOAT64: return 8;
    case M40_GGUF_STRING: return 8;
    case M40_GGUF_ARRAY: return 12;
    default: return 0;
    }
}

static int parse_value(parser *ps, uint32_t type, int depth, m40_gguf_value *out)
{
    uint8_t b[8];
    memset(out, 0, sizeof *out);
    out->type = (m40_gguf_type)type;
    size_t sz = value_min_size(type);
    switch (type) {
    case M40_GGUF_UINT8: case M40_GGUF_UINT16: case M40_GGUF_UINT32: case M40_GGUF_UINT64:
    case M40_GGUF_INT8: case M40_GGUF_INT16: case M40_GGUF_INT32: case M40_GGUF_INT64: {
        if (rd_bytes(ps, b, sz, "value"))
            return -1;
        uint64_t x = 0;
        for (size_t i = sz; i-- > 0;)
            x = x << 8 | b[i];
        if (type == M40_GGUF_UINT8 || type == M40_GGUF_UINT16 || type == M40_GGUF_UINT32 || type == M40_GGUF_UINT64) {
            out->v.u64 = x;
        } else {
            /* sign-extend from sz bytes */
            unsigned shift = (unsigned)(64 - 8 * sz);
            out->v.i64 = shift ? (int64_t)(x << shift) >> shift : (int64_t)x;
        }
        return 0;
    }
    case M40_GGUF_FLOAT32: {
        uint32_t x;
        float f;
        if (rd_u32(ps, &x, "value"))
            return -1;
        memcpy(&f, &x, 4);
        out->v.f64 = f;
        return 0;
    }
    case M40_GGUF_FLOAT64: {
        uint64_t x;
        double d;
        if (rd_u64(ps, &x, "value"))
            return -1;
        memcpy(&d, &x, 8);
        out->v.f64 = d;
        return 0;
    }
    case M40_GGUF_BOOL:
        if (rd_bytes(ps, b, 1, "value"))
            return -1;
        if (b[0] > 1) {
            char w[256];
            where(ps, w, sizeof w);
            return fail(ps, "%s: bool value %u is neither 0 nor 1 at offset %zu", w, b[0], ps->pos - 1);
        }
        out->v.b = b[0];
        return 0;
    case M40_GGUF_STRING:
        return rd_string(ps, &out->v.str.ptr, &out->v.str.len, 0, "string");
    case M40_GGUF_ARRAY: {
        char w[256];
        uint32_t et;
        uint64_t n;
        if (depth >= GGUF_MAX_NESTING) {
            where(ps, w, sizeof w);
            return fail(ps, "%s: arrays nested deeper than %d levels at offset %zu", w, GGUF_MAX_NESTING, ps->pos);
        }
        if (rd_u32(ps, &et, "array element type"))
            return -1;
        size_t esz = value_min_size(et);
        if (!esz) {
            where(ps, w, sizeof w);
            return fail(ps, "%s: unknown array element type %u at offset %zu", w, et, ps->pos - 4);
        }
        if (rd_u64(ps, &n, "array count"))
            return -1;
        if (n > remaining(ps) / esz || n > SIZE_MAX / sizeof(m40_gguf_value)) {
            where(ps, w, sizeof w);
            return fail(ps, "truncated file: %s array count %llu of %s cannot fit in the %zu bytes left at offset %zu", w,
                        (unsigned long long)n, m40_gguf_type_name((m40_gguf_type)et), remaining(ps), ps->pos - 8);
        }
        out->v.arr.type = (m40_gguf_type)et;
        out->v.arr.n = n;
        if (n == 0)
            return 0;
        m40_gguf_value *items = arena_alloc(&ps->g->arena, (size_t)n * sizeof *items, _Alignof(m40_gguf_value));
        if (!items)
            return fail(ps, "out of memory for an array of %llu items", (unsigned long long)n);
        out->v.arr.items = items;
        ps->depth = depth + 1;
        for (uint64_t i = 0; i < n; i++) {
            ps->item[depth] = i;
            if (parse_value(ps, et, depth + 1, &items[i]))
                return -1;
        }
        ps->depth = depth;
        return 0;
    }
    default: {
        char w[256];
        where(ps, w, sizeof w);
        return fail(ps, "%s: unknown value type %u at offset %zu", w, type, ps->pos);
    }
    }
}

static int is_integer_type(m40_gguf_type t)
{
    return t == M40_GGUF_UINT8 || t == M40_GGUF_INT8 || t == M40_GGUF_UINT16 || t == M40_GGUF_INT16 ||
           t == M40_GGUF_UINT32 || t == M40_GGUF_INT32 || t == M40_GGUF_UINT64 || t == M40_GGUF_INT64;
}

static int is_signed_type(m40_gguf_type t)
{
    return t == M40_GGUF_INT8 || t == M40_GGUF_INT16 || t == M40_GGUF_INT32 || t == M40_GGUF_INT64;
}

static int parse_header(parser *ps)
{
    m40_gguf *g = ps->g;
    uint8_t magic[4];
    uint32_t version;
    if (ps->size < 4)
        return fail(ps, "truncated file: %zu bytes is too short for the GGUF magic", ps->size);
    memcpy(magic, ps->p, 4);
    if (memcmp(magic, "GGUF", 4)) {
        char shown[5];
        for (int i = 0; i < 4; i++)
            shown[i] = magic[i] >= 0x20 && magic[i] < 0x7f ? (char)magic[i] : '?';
        shown[4] = 0;
        return fail(ps, "bad magic: not a GGUF file (starts with '%s', %02x %02x %02x %02x)", shown, magic[0], magic[1],
                    magic[2], magic[3]);
    }
    ps->pos = 4;
    if (rd_u32(ps, &version, "header version"))
        return -1;
    uint32_t swapped = __builtin_bswap32(version);
    if (version > 0xffff && swapped >= 1 && swapped <= 3)
        return fail(ps, "big-endian GGUF file (version %u byte-swapped): not supported", swapped);
    if (version == 1)
        return fail(ps, "GGUF version 1 is not supported (only versions 2 and 3)");
    if (version != 2 && version != 3)
        return fail(ps, "unsupported GGUF version %u (only versions 2 and 3)", version);
    g->version = version;
    if (rd_u64(ps, &g->n_tensors, "header tensor count") || rd_u64(ps, &g->n_kv, "header kv count"))
        return -1;
    /* a tensor info takes at least 32 bytes (empty name, 1 dim), a kv at least 13
     * (empty key, type, one byte): counts the file cannot hold fail here, before any
     * allocation is sized by them */
    size_t left = remaining(ps);
    if (g->n_tensors > left / 32)
        return fail(ps, "tensor count %llu is impossible in a file of %zu bytes (header at offset 8)",
                    (unsigned long long)g->n_tensors, ps->size);
    if (g->n_kv > left / 13)
        return fail(ps, "kv count %llu is impossible in a file of %zu bytes (header at offset 16)",
                    (unsigned long long)g->n_kv, ps->size);
    if (g->n_kv * 13 + g->n_tensors * 32 > left)
        return fail(ps, "kv count %llu and tensor count %llu are impossible in a file of %zu bytes",
                    (unsigned long long)g->n_kv, (unsigned long long)g->n_tensors, ps->size);
    return 0;
}

static int parse_kvs(parser *ps)
{
    m40_gguf *g = ps->g;
    if (g->n_kv) {
        g->kvs = calloc((size_t)g->n_kv, sizeof *g->kvs);
        if (!g->kvs)
            return fail(ps, "out of memory for %llu kvs", (unsigned long long)g->n_kv);
    }
    if (name_index_init(&g->kv_index, g->n_kv))
        return fail(ps, "out of memory for the kv index");
    for (uint64_t i = 0; i < g->n_kv; i++) {
        m40_gguf_kv *kv = &g->kvs[i];
        uint32_t type;
        ps->index = i;
        ps->name = NULL;
        ps->depth = 0;
        size_t key_at = ps->pos;
        if (rd_string(ps, &kv->key, NULL, 1, "key"))
            return -1;
        ps->name = kv->key;
        uint64_t dup;
        size_t slot = name_index_find(&g->kv_index, kv->key, kv_name_of, g, &dup);
        if (dup != UINT64_MAX)
            return fail(ps, "duplicate key '%s': kv %llu at offset %zu repeats kv %llu", kv->key, (unsigned long long)i,
                        key_at, (unsigned long long)dup);
        if (rd_u32(ps, &type, "value type"))
            return -1;
        if (parse_value(ps, type, 0, &kv->value))
            return -1;
        g->kv_index.slots[slot] = i + 1;
    }
    ps->depth = 0;
    return 0;
}

static int read_alignment(parser *ps)
{
    m40_gguf *g = ps->g;
    const m40_gguf_value *a = m40_gguf_get(g, "general.alignment");
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    if (!a)
        return 0;
    if (!is_integer_type(a->type))
        return fail(ps, "general.alignment has type %s, expected an integer", m40_gguf_type_name(a->type));
    if (is_signed_type(a->type) && a->v.i64 < 0)
        return fail(ps, "general.alignment %lld is negative", (long long)a->v.i64);
    uint64_t v = a->v.u64;
    if (v == 0)
        return fail(ps, "general.alignment is 0; it must be a non-zero power of two");
    if (v & (v - 1))
        return fail(ps, "general.alignment %llu is not a power of two", (unsigned long long)v);
    g->alignment = v;
    return 0;
}

static int parse_tensor_infos(parser *ps)
{
    m40_gguf *g = ps->g;
    ps->in_tensors = 1;
    if (g->n_tensors) {
        g->tensors = calloc((size_t)g->n_tensors, sizeof *g->tensors);
        if (!g->tensors)
            return fail(ps, "out of memory for %llu tensor infos", (unsigned long long)g->n_tensors);
    }
    if (name_index_init(&g->tensor_index, g->n_tensors))
        return fail(ps, "out of memory for the tensor index");
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        m40_gguf_tensor *t = &g->tensors[i];
        ps->index = i;
        ps->name = NULL;
        size_t at = ps->pos;
        if (rd_string(ps, &t->name, NULL, 1, "name"))
            return -1;
        ps->name = t->name;
        uint64_t dup;
        size_t slot = name_index_find(&g->tensor_index, t->name, tensor_name_of, g, &dup);
        if (dup != UINT64_MAX)
            return fail(ps, "duplicate tensor name '%s': tensor info %llu at offset %zu repeats tensor info %llu",
                        t->name, (unsigned long long)i, at, (unsigned long long)dup);
        g->tensor_index.slots[slot] = i + 1;
        if (rd_u32(ps, &t->n_dims, "n_dims"))
            return -1;
        if (t->n_dims < 1 || t->n_dims > M40_GGUF_MAX_DIMS)
            return fail(ps, "tensor '%s': n_dims %u out of range 1..%d at offset %zu", t->name, t->n_dims,
                        M40_GGUF_MAX_DIMS, ps->pos - 4);
        uint64_t n_elems = 1;
        for (uint32_t d = 0; d < M40_GGUF_MAX_DIMS; d++)
            t->ne[d] = 1;
        for (uint32_t d = 0; d < t->n_dims; d++) {
            if (rd_u64(ps, &t->ne[d], "dimension"))
                return -1;
            if (t->ne[d] == 0)
                return fail(ps, "tensor '%s': dimension %u is zero at offset %zu", t->name, d, ps->pos - 8);
            /* element counts stay below 2^63 so that users may hold them in int64 */
            if (t->ne[d] > (uint64_t)INT64_MAX / n_elems)
                return fail(ps, "tensor '%s': element count overflows (dimension %u = %llu) at offset %zu", t->name, d,
                            (unsigned long long)t->ne[d], ps->pos - 8);
            n_elems *= t->ne[d];
        }
        t->n_elems = n_elems;
        if (rd_u32(ps, &t->type, "type"))
            return -1;
        const m40_type_info *ti = m40_type_get(t->type);
        if (!ti)
            return fail(ps, "tensor '%s': unknown type id %u at offset %zu", t->name, t->type, ps->pos - 4);
        if (t->ne[0] % ti->block_elems)
            return fail(ps, "tensor '%s': row length %llu is not a multiple of the %s block size %u", t->name,
                        (unsigned long long)t->ne[0], ti->name, ti->block_elems);
        if (m40_type_nbytes(t->type, n_elems, &t->nbytes))
            return fail(ps, "tensor '%s': byte size of %llu %s elements overflows", t->name,
                        (unsigned long long)n_elems, ti->name);
        if (rd_u64(ps, &t->offset, "data offset"))
            return -1;
        if (t->offset % g->alignment)
            return fail(ps, "tensor '%s': data offset %llu is not aligned to %llu (at offset %zu)", t->name,
                        (unsigned long long)t->offset, (unsigned long long)g->alignment, ps->pos - 8);
    }
    ps->name = NULL;

    /* the data section starts at the next multiple of the alignment */
    uint64_t pos = ps->pos;
    uint64_t pad = (g->alignment - pos % g->alignment) % g->alignment;
    if (pad > UINT64_MAX - pos)
        return fail(ps, "data section offset overflows (alignment %llu)", (unsigned long long)g->alignment);
    g->data_offset = pos + pad;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        m40_gguf_tensor *t = &g->tensors[i];
        uint64_t start = g->data_offset + t->offset, end = start + t->nbytes;
        if (t->offset > UINT64_MAX - g->data_offset || t->nbytes > UINT64_MAX - start)
            return fail(ps, "tensor '%s': data offset %llu + size %llu overflows", t->name,
                        (unsigned long long)t->offset, (unsigned long long)t->nbytes);
        if (end > ps->size)
            return fail(ps, "tensor '%s': data range [%llu, %llu) past end of file (size %zu)", t->name,
                        (unsigned long long)start, (unsigned long long)end, ps->size);
        t->data = ps->p + start;
    }
    return 0;
}

static int parse(m40_gguf *g, char *err, size_t errlen)
{
    parser ps = {.g = g, .p = g->base, .size = g->size, .err = err, .errlen = errlen};
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    if (parse_header(&ps) || parse_kvs(&ps) || read_alignment(&ps) || parse_tensor_infos(&ps))
        return -1;
    return 0;
}

int m40_gguf_open_mem(const void *data, size_t size, m40_gguf **out, char *err, size_t errlen)
{
    *out = NULL;
    if (!data && size) {
        snprintf(err, errlen, "no buffer given");
        return -1;
    }
    m40_gguf *g = calloc(1, sizeof *g);
    if (!g) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    g->base = data;
    g->size = size;
    if (parse(g, err, errlen)) {
        m40_gguf_close(g);
        return -1;
    }
    *out = g;
    return 0;
}

int m40_gguf_open(const char *path, m40_gguf **out, char *err, size_t errlen)
{
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "cannot open: %s", strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        snprintf(err, errlen, "cannot stat: %s", strerror(errno));
        close(fd);
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        snprintf(err, errlen, "not a regular file");
        close(fd);
        return -1;
    }
    if (st.st_size < 4) {
        snprintf(err, errlen, "truncated file: %lld bytes is too short for a GGUF header", (long long)st.st_size);
        close(fd);
        return -1;
    }
    if ((uint64_t)st.st_size > SIZE_MAX) {
        snprintf(err, errlen, "file of %lld bytes does not fit in the address space", (long long)st.st_size);
        close(fd);
        return -1;
    }
    size_t size = (size_t)st.st_size;
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    close(fd); /* the mapping keeps the file referenced */
    if (map == MAP_FAILED) {
        snprintf(err, errlen, "cannot mmap %zu bytes: %s", size, strerror(map_errno));
        return -1;
    }
    m40_gguf *g = calloc(1, sizeof *g);
    if (!g) {
        munmap(map, size);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    g->base = map;
    g->size = size;
    g->map = map;
    g->map_size = size;
    if (parse(g, err, errlen)) {
        m40_gguf_close(g);
        return -1;
    }
    *out = g;
    return 0;
}

void m40_gguf_close(m40_gguf *g)
{
    if (!g)
        return;
    if (g->map)
        munmap(g->map, g->map_size);
    free(g->kvs);
    free(g->tensors);
    free(g->kv_index.slots);
    free(g->tensor_index.slots);
    arena_free(&g->arena);
    free(g);
}

/* ---------- accessors ---------- */

uint32_t m40_gguf_version(const m40_gguf *g) { return g->version; }
uint64_t m40_gguf_alignment(const m40_gguf *g) { return g->alignment; }
uint64_t m40_gguf_data_offset(const m40_gguf *g) { return g->data_offset; }
uint64_t m40_gguf_file_size(const m40_gguf *g) { return g->size; }
uint64_t m40_gguf_n_kv(const m40_gguf *g) { return g->n_kv; }
uint64_t m40_gguf_n_tensors(const m40_gguf *g) { return g->n_tensors; }

const m40_gguf_kv *m40_gguf_kv_at(const m40_gguf *g, uint64_t i)
{
    return i < g->n_kv ? &g->kvs[i] : NULL;
}

const m40_gguf_tensor *m40_gguf_tensor_at(const m40_gguf *g, uint64_t i)
{
    return i < g->n_tensors ? &g->tensors[i] : NULL;
}

const m40_gguf_value *m40_gguf_get(const m40_gguf *g, const char *key)
{
    uint64_t i;
    if (!g->kv_index.slots || !key)
        return NULL;
    name_index_find(&g->kv_index, key, kv_name_of, g, &i);
    return i == UINT64_MAX ? NULL : &g->kvs[i].value;
}

const m40_gguf_tensor *m40_gguf_find_tensor(const m40_gguf *g, const char *name)
{
    uint64_t i;
    if (!g->tensor_index.slots || !name)
        return NULL;
    name_index_find(&g->tensor_index, name, tensor_name_of, g, &i);
    return i == UINT64_MAX ? NULL : &g->tensors[i];
}

int m40_gguf_get_u32(const m40_gguf *g, const char *key, uint32_t *out)
{
    const m40_gguf_value *v = m40_gguf_get(g, key);
    if (!v || !is_integer_type(v->type))
        return -1;
    if (is_signed_type(v->type)) {
        if (v->v.i64 < 0 || v->v.i64 > (int64_t)UINT32_MAX)
            return -1;
        *out = (uint32_t)v->v.i64;
    } else {
        if (v->v.u64 > UINT32_MAX)
            return -1;
        *out = (uint32_t)v->v.u64;
    }
    return 0;
}

int m40_gguf_get_i64(const m40_gguf *g, const char *key, int64_t *out)
{
    const m40_gguf_value *v = m40_gguf_get(g, key);
    if (!v || !is_integer_type(v->type))
        return -1;
    if (is_signed_type(v->type)) {
        *out = v->v.i64;
    } else {
        if (v->v.u64 > (uint64_t)INT64_MAX)
            return -1;
        *out = (int64_t)v->v.u64;
    }
    return 0;
}

int m40_gguf_get_f32(const m40_gguf *g, const char *key, float *out)
{
    const m40_gguf_value *v = m40_gguf_get(g, key);
    if (!v)
        return -1;
    if (v->type == M40_GGUF_FLOAT32 || v->type == M40_GGUF_FLOAT64)
        *out = (float)v->v.f64;
    else if (is_signed_type(v->type))
        *out = (float)v->v.i64;
    else if (is_integer_type(v->type))
        *out = (float)v->v.u64;
    else
        return -1;
    return 0;
}

int m40_gguf_get_bool(const m40_gguf *g, const char *key, int *out)
{
    const m40_gguf_value *v = m40_gguf_get(g, key);
    if (!v || v->type != M40_GGUF_BOOL)
        return -1;
    *out = v->v.b;
    return 0;
}

const char *m40_gguf_get_str(const m40_gguf *g, const char *key)
{
    const m40_gguf_value *v = m40_gguf_get(g, key);
    return v && v->type == M40_GGUF_STRING ? v->v.str.ptr : NULL;
}

const m40_gguf_value *m40_gguf_get_arr(const m40_gguf *g, const char *key, m40_gguf_type elem_type)
{
    const m40_gguf_value *v = m40_gguf_get(g, key);
    return v && v->type == M40_GGUF_ARRAY && v->v.arr.type == elem_type ? v : NULL;
}

const char *m40_gguf_arch(const m40_gguf *g)
{
    return m40_gguf_get_str(g, "general.architecture");
}

/* "<arch>.<suffix>" into buf; -1 when there is no architecture or it does not fit */
static int arch_key(const m40_gguf *g, const char *suffix, char *buf, size_t cap)
{
    const char *arch = m40_gguf_arch(g);
    if (!arch || !suffix)
        return -1;
    int n = snprintf(buf, cap, "%s.%s", arch, suffix);
    return n < 0 || (size_t)n >= cap ? -1 : 0;
}

int m40_gguf_get_arch_u32(const m40_gguf *g, const char *suffix, uint32_t *out)
{
    char key[256];
    return arch_key(g, suffix, key, sizeof key) ? -1 : m40_gguf_get_u32(g, key, out);
}

int m40_gguf_get_arch_f32(const m40_gguf *g, const char *suffix, float *out)
{
    char key[256];
    return arch_key(g, suffix, key, sizeof key) ? -1 : m40_gguf_get_f32(g, key, out);
}

const char *m40_gguf_type_name(m40_gguf_type t)
{
    switch (t) {
    case M40_GGUF_UINT8: return "uint8";
    case M40_GGUF_INT8: return "int8";
    case M40_GGUF_UINT16: return "uint16";
    case M40_GGUF_INT16: return "int16";
    case M40_GGUF_UINT32: return "uint32";
    case M40_GGUF_INT32: return "int32";
    case M40_GGUF_FLOAT32: return "float32";
    case M40_GGUF_BOOL: return "bool";
    case M40_GGUF_STRING: return "string";
    case M40_GGUF_ARRAY: return "array";
    case M40_GGUF_UINT64: return "uint64";
    case M40_GGUF_INT64: return "int64";
    case M40_GGUF_FLOAT64: return "float64";
    }
    return "unknown";
}
