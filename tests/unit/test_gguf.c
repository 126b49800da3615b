/* GGUF reader and writer: every shared model and vocabulary opens with the expected
 * metadata and shapes; the writer round-trips every value type; and hostile files
 * (truncations at every length, absurd counts and lengths, bad shapes, types, offsets,
 * alignments, duplicates, deep nesting, random byte flips) fail with a message that
 * names the problem instead of crashing. Buffers handed to the reader are exact-size
 * heap copies so that an overread shows up under valgrind or -fsanitize=address. */
#include <dirent.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "ref/ggml_types.h"
#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"

/* ---------- helpers ---------- */

static int open_copy(const void *buf, size_t len, m40_gguf **g, char *err, size_t errlen)
{
    void *copy = malloc(len ? len : 1);
    if (!copy) {
        snprintf(err, errlen, "test: out of memory");
        return -2;
    }
    memcpy(copy, buf, len);
    int rc = m40_gguf_open_mem(copy, len, g, err, errlen);
    if (rc == 0) {
        /* the handle points into the copy, which dies here: callers only learn
         * whether it opened */
        m40_gguf_close(*g);
        *g = NULL;
    }
    free(copy);
    return rc;
}

/* Expects the buffer to be rejected with a message containing want. */
static void expect_fail(const char *what, const void *buf, size_t len, const char *want)
{
    char err[512] = "";
    m40_gguf *g = NULL;
    int rc = open_copy(buf, len, &g, err, sizeof err);
    CHECK(rc == -1, "%s: expected failure, got rc %d", what, rc);
    CHECK(g == NULL, "%s: handle not NULL on failure", what);
    CHECK(strstr(err, want) != NULL, "%s: message '%s' lacks '%s'", what, err, want);
}

static void expect_ok(const char *what, const void *buf, size_t len)
{
    char err[512] = "";
    m40_gguf *g = NULL;
    int rc = open_copy(buf, len, &g, err, sizeof err);
    CHECK(rc == 0, "%s: expected success: %s", what, err);
}

static void put_u32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static void put_u64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

/* Offset just past the first occurrence of the length-prefixed string s (a key or a
 * tensor name) in buf; 0 when absent. */
static size_t after_string(const unsigned char *buf, size_t len, const char *s)
{
    size_t n = strlen(s);
    for (size_t i = 8; i + n <= len; i++) {
        if (!memcmp(buf + i, s, n)) {
            uint64_t l = 0;
            for (int k = 7; k >= 0; k--)
                l = l << 8 | buf[i - 8 + k];
            if (l == n)
                return i + n;
        }
    }
    return 0;
}

/* The small valid file the hostile tests corrupt: a few kinds of metadata, one
 * vocabulary, a nested array and three tensors of different types. */
static unsigned char *build_base(size_t *len)
{
    m40_gguf_writer *w = m40_gguf_writer_new();
    if (!w)
        return NULL;
    m40_gguf_writer_set_str(w, "general.architecture", "llama");
    m40_gguf_writer_set_str(w, "general.name", "hostile-base");
    m40_gguf_writer_set_u32(w, "llama.block_count", 2);
    m40_gguf_writer_set_f32(w, "llama.rope.freq_base", 10000.0f);
    m40_gguf_writer_set_bool(w, "flag.value", 1);
    m40_gguf_writer_set_u32(w, "dup.key1", 7);
    m40_gguf_writer_set_u32(w, "dup.key2", 8);
    const char *toks[] = {"<unk>", "<s>", "</s>", "hello", "world", "tokenXYZ", ""};
    m40_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, 7);
    float scores[] = {0, 0, 0, -1.5f, -2.5f, -3.5f, -4.5f};
    m40_gguf_writer_set_arr_f32(w, "tokenizer.ggml.scores", scores, 7);
    /* [[1, 2], [3]] as a value tree */
    m40_gguf_value leaf[3], inner[2], outer;
    for (int i = 0; i < 3; i++) {
        leaf[i].type = M40_GGUF_INT32;
        leaf[i].v.i64 = i + 1;
    }
    inner[0].type = inner[1].type = M40_GGUF_ARRAY;
    inner[0].v.arr.type = inner[1].v.arr.type = M40_GGUF_INT32;
    inner[0].v.arr.n = 2;
    inner[0].v.arr.items = leaf;
    inner[1].v.arr.n = 1;
    inner[1].v.arr.items = leaf + 2;
    outer.type = M40_GGUF_ARRAY;
    outer.v.arr.type = M40_GGUF_ARRAY;
    outer.v.arr.n = 2;
    outer.v.arr.items = inner;
    m40_gguf_writer_set_value(w, "nested.arr", &outer);

    float a[2 * 3];
    for (int i = 0; i < 6; i++)
        a[i] = (float)i * 0.5f;
    uint64_t ne_a[2] = {3, 2};
    m40_gguf_writer_add_tensor(w, "tensor_alpha", M40_TYPE_F32, 2, ne_a, a, sizeof a);
    unsigned char q[34 * 2];
    for (size_t i = 0; i < sizeof q; i++)
        q[i] = (unsigned char)(i * 7);
    uint64_t ne_q[2] = {32, 2};
    m40_gguf_writer_add_tensor(w, "tensor_q8", M40_TYPE_Q8_0, 2, ne_q, q, sizeof q);
    uint64_t ne_b[1] = {5};
    m40_gguf_writer_add_tensor(w, "tensor_bbbb", M40_TYPE_F32, 1, ne_b, NULL, 20);
    void *out = NULL;
    char err[256];
    if (m40_gguf_writer_write_mem(w, &out, len, err, sizeof err)) {
        fprintf(stderr, "build_base: %s\n", err);
        out = NULL;
    }
    m40_gguf_writer_free(w);
    return out;
}

/* ---------- (1) shared fixtures ---------- */

static void check_one_file(const char *path, int is_model)
{
    char err[512];
    m40_gguf *g;
    if (m40_gguf_open(path, &g, err, sizeof err)) {
        CHECK(0, "%s does not open: %s", path, err);
        return;
    }
    CHECK(m40_gguf_version(g) == 2 || m40_gguf_version(g) == 3, "%s: version %u", path, m40_gguf_version(g));
    CHECK(m40_gguf_arch(g) != NULL, "%s: no general.architecture", path);
    const m40_gguf_value *tok = m40_gguf_get_arr(g, "tokenizer.ggml.tokens", M40_GGUF_STRING);
    CHECK(tok && tok->v.arr.n > 0, "%s: no tokenizer.ggml.tokens", path);
    CHECK(m40_gguf_get_str(g, "tokenizer.ggml.model") != NULL, "%s: no tokenizer.ggml.model", path);
    if (is_model) {
        CHECK(m40_gguf_n_tensors(g) > 0, "%s: no tensors", path);
        uint32_t blocks;
        CHECK(m40_gguf_get_arch_u32(g, "block_count", &blocks) == 0 && blocks > 0, "%s: no block_count", path);
        int bad = 0;
        for (uint64_t i = 0; i < m40_gguf_n_tensors(g); i++) {
            const m40_gguf_tensor *t = m40_gguf_tensor_at(g, i);
            if ((m40_gguf_data_offset(g) + t->offset) % m40_gguf_alignment(g) ||
                m40_gguf_data_offset(g) + t->offset + t->nbytes > m40_gguf_file_size(g) ||
                m40_gguf_find_tensor(g, t->name) != t)
                bad++;
        }
        CHECK(bad == 0, "%s: %d tensors misplaced or not found by name", path, bad);
    }
    m40_gguf_close(g);
}

static void test_shared_dir(const char *rel, int is_model)
{
    char dir[8192];
    if (!check_shared_file(rel, dir, sizeof dir)) {
        SKIP("shared fixtures %s absent", rel);
        return;
    }
    DIR *d = opendir(dir);
    if (!d) {
        SKIP("cannot list %s", dir);
        return;
    }
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t l = strlen(e->d_name);
        if (l < 5 || strcmp(e->d_name + l - 5, ".gguf"))
            continue;
        char path[16384];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        check_one_file(path, is_model);
        n++;
    }
    closedir(d);
    CHECK(n > 0, "no .gguf files in %s", dir);
}

static void test_stories(void)
{
    char path[8192], err[512];
    m40_gguf *g;
    if (!check_shared_file("models/stories260K.gguf", path, sizeof path)) {
        SKIP("models/stories260K.gguf absent");
        return;
    }
    if (m40_gguf_open(path, &g, err, sizeof err)) {
        CHECK(0, "stories260K: %s", err);
        return;
    }
    uint32_t v;
    CHECK(!strcmp(m40_gguf_arch(g), "llama"), "arch %s", m40_gguf_arch(g));
    CHECK(m40_gguf_get_arch_u32(g, "block_count", &v) == 0 && v == 5, "block_count %u", v);
    CHECK(m40_gguf_get_arch_u32(g, "embedding_length", &v) == 0 && v == 64, "embedding_length %u", v);
    CHECK(m40_gguf_get_arch_u32(g, "attention.head_count", &v) == 0 && v == 8, "head_count %u", v);
    CHECK(m40_gguf_get_arch_u32(g, "attention.head_count_kv", &v) == 0 && v == 4, "head_count_kv %u", v);
    CHECK(m40_gguf_get_arch_u32(g, "feed_forward_length", &v) == 0 && v == 172, "ffn %u", v);
    float eps;
    CHECK(m40_gguf_get_arch_f32(g, "attention.layer_norm_rms_epsilon", &eps) == 0 && eps > 0 && eps < 1e-3f,
          "rms eps %g", eps);
    CHECK(m40_gguf_get_arch_u32(g, "no_such_key", &v) == -1, "absent key read");
    const m40_gguf_tensor *t = m40_gguf_find_tensor(g, "token_embd.weight");
    CHECK(t && t->type == M40_TYPE_F32 && t->n_dims == 2 && t->ne[0] == 64 && t->ne[1] == 512 && t->ne[2] == 1 &&
              t->n_elems == 64 * 512 && t->nbytes == 64 * 512 * 4,
          "token_embd.weight shape");
    t = m40_gguf_find_tensor(g, "output_norm.weight");
    int finite = t && t->n_dims == 1 && t->ne[0] == 64;
    for (uint64_t i = 0; finite && i < t->n_elems; i++) {
        float f;
        memcpy(&f, (const char *)t->data + 4 * i, 4);
        finite = isfinite(f) && fabsf(f) < 100;
    }
    CHECK(finite, "output_norm.weight missing or holds non-finite / absurd values (data pointer wrong?)");
    CHECK(m40_gguf_find_tensor(g, "blk.4.ffn_down.weight") != NULL, "blk.4.ffn_down.weight missing");
    CHECK(m40_gguf_find_tensor(g, "blk.5.ffn_down.weight") == NULL, "blk.5 should not exist");
    const m40_gguf_value *tok = m40_gguf_get_arr(g, "tokenizer.ggml.tokens", M40_GGUF_STRING);
    CHECK(tok && tok->v.arr.n == 512, "vocab size");
    CHECK(m40_gguf_get_arr(g, "tokenizer.ggml.tokens", M40_GGUF_INT32) == NULL, "wrong elem type accepted");
    CHECK(!strcmp(m40_gguf_get_str(g, "tokenizer.ggml.model"), "llama"), "tokenizer model");
    CHECK(m40_gguf_get_u32(g, "tokenizer.ggml.model", &v) == -1, "string read as u32");
    CHECK(m40_gguf_get_str(g, "llama.block_count") == NULL, "u32 read as string");
    m40_gguf_close(g);
}

static void test_qwen(void)
{
    char path[8192], err[512];
    m40_gguf *g;
    if (!check_shared_file("models/tiny-qwen2-gpt2-f16.gguf", path, sizeof path)) {
        SKIP("models/tiny-qwen2-gpt2-f16.gguf absent");
        return;
    }
    if (m40_gguf_open(path, &g, err, sizeof err)) {
        CHECK(0, "tiny-qwen2: %s", err);
        return;
    }
    float base;
    uint32_t v;
    CHECK(!strcmp(m40_gguf_arch(g), "qwen2"), "arch");
    CHECK(!strcmp(m40_gguf_get_str(g, "tokenizer.ggml.model"), "gpt2"), "tokenizer gpt2");
    CHECK(m40_gguf_get_arch_f32(g, "rope.freq_base", &base) == 0 && base == 1e6f, "rope base %g", base);
    CHECK(m40_gguf_get_arch_u32(g, "attention.head_count_kv", &v) == 0 && v == 2, "head_count_kv");
    const m40_gguf_value *tok = m40_gguf_get_arr(g, "tokenizer.ggml.tokens", M40_GGUF_STRING);
    CHECK(tok && tok->v.arr.n == 50257, "vocab 50257");
    const m40_gguf_value *merges = m40_gguf_get_arr(g, "tokenizer.ggml.merges", M40_GGUF_STRING);
    CHECK(merges && merges->v.arr.n > 0 && strchr(merges->v.arr.items[0].v.str.ptr, ' '), "merges look like 'a b'");
    const m40_gguf_tensor *t = m40_gguf_find_tensor(g, "token_embd.weight");
    CHECK(t && t->type == M40_TYPE_F16 && t->ne[0] == 64 && t->ne[1] == 50257, "token_embd F16 64x50257");
    CHECK(m40_gguf_find_tensor(g, "blk.0.attn_q.bias") != NULL, "qkv bias present");
    m40_gguf_close(g);
}

static void test_q4km(void)
{
    char path[8192], err[512];
    m40_gguf *g;
    if (!check_shared_file("models/tiny-llama-q4km.gguf", path, sizeof path)) {
        SKIP("models/tiny-llama-q4km.gguf absent");
        return;
    }
    if (m40_gguf_open(path, &g, err, sizeof err)) {
        CHECK(0, "q4km: %s", err);
        return;
    }
    int q4k = 0, q6k = 0;
    for (uint64_t i = 0; i < m40_gguf_n_tensors(g); i++) {
        const m40_gguf_tensor *t = m40_gguf_tensor_at(g, i);
        q4k += t->type == M40_TYPE_Q4_K;
        q6k += t->type == M40_TYPE_Q6_K;
        if (t->type == M40_TYPE_Q4_K)
            CHECK(t->nbytes == t->n_elems / 256 * 144, "%s: Q4_K size", t->name);
    }
    CHECK(q4k > 0 && q6k > 0, "Q4_K_M mixes Q4_K (%d) and Q6_K (%d)", q4k, q6k);
    m40_gguf_close(g);
}

/* ---------- (2) writer round trip ---------- */

static void test_roundtrip(void)
{
    m40_gguf_writer *w = m40_gguf_writer_new();
    CHECK(w != NULL, "writer_new");
    if (!w)
        return;
    m40_gguf_writer_set_u32(w, "general.alignment", 64);
    m40_gguf_writer_set_u8(w, "t.u8", 255);
    m40_gguf_writer_set_i8(w, "t.i8", -128);
    m40_gguf_writer_set_u16(w, "t.u16", 65535);
    m40_gguf_writer_set_i16(w, "t.i16", -32768);
    m40_gguf_writer_set_u32(w, "t.u32", UINT32_MAX);
    m40_gguf_writer_set_i32(w, "t.i32", INT32_MIN);
    m40_gguf_writer_set_u64(w, "t.u64", UINT64_MAX);
    m40_gguf_writer_set_i64(w, "t.i64", INT64_MIN);
    m40_gguf_writer_set_f32(w, "t.f32", 1.25f);
    m40_gguf_writer_set_f64(w, "t.f64", 3.141592653589793);
    m40_gguf_writer_set_bool(w, "t.true", 1);
    m40_gguf_writer_set_bool(w, "t.false", 0);
    m40_gguf_writer_set_str(w, "t.str", "héllo");
    m40_gguf_writer_set_str(w, "t.empty", "");
    m40_gguf_writer_set_str_n(w, "t.nul", "a\0b", 3);
    float f[3] = {1.5f, -2.0f, 1e30f};
    m40_gguf_writer_set_arr_f32(w, "t.arr_f32", f, 3);
    int32_t i32[4] = {0, -1, INT32_MAX, INT32_MIN};
    m40_gguf_writer_set_arr_i32(w, "t.arr_i32", i32, 4);
    uint8_t bools[3] = {1, 0, 1};
    m40_gguf_writer_set_arr(w, "t.arr_bool", M40_GGUF_BOOL, bools, 3);
    uint64_t u64s[2] = {UINT64_MAX, 42};
    m40_gguf_writer_set_arr(w, "t.arr_u64", M40_GGUF_UINT64, u64s, 2);
    int16_t i16s[2] = {-5, 300};
    m40_gguf_writer_set_arr(w, "t.arr_i16", M40_GGUF_INT16, i16s, 2);
    double f64s[1] = {-0.5};
    m40_gguf_writer_set_arr(w, "t.arr_f64", M40_GGUF_FLOAT64, f64s, 1);
    m40_gguf_writer_set_arr(w, "t.arr_empty", M40_GGUF_UINT8, NULL, 0);
    const char *strs[3] = {"x", "", "longer string"};
    m40_gguf_writer_set_arr_str(w, "t.arr_str", strs, 3);
    /* [["a", "bc"], [], ["d"]] */
    m40_gguf_value s[3], in[3], out;
    const char *sv[3] = {"a", "bc", "d"};
    for (int i = 0; i < 3; i++) {
        s[i].type = M40_GGUF_STRING;
        s[i].v.str.ptr = sv[i];
        s[i].v.str.len = strlen(sv[i]);
        in[i].type = M40_GGUF_ARRAY;
        in[i].v.arr.type = M40_GGUF_STRING;
    }
    in[0].v.arr.n = 2, in[0].v.arr.items = s;
    in[1].v.arr.n = 0, in[1].v.arr.items = NULL;
    in[2].v.arr.n = 1, in[2].v.arr.items = s + 2;
    out.type = M40_GGUF_ARRAY;
    out.v.arr.type = M40_GGUF_ARRAY;
    out.v.arr.n = 3;
    out.v.arr.items = in;
    m40_gguf_writer_set_value(w, "t.nested", &out);

    float ta[4 * 3];
    for (int i = 0; i < 12; i++)
        ta[i] = (float)i - 5.5f;
    uint64_t ne_a[2] = {4, 3};
    m40_gguf_writer_add_tensor(w, "a", M40_TYPE_F32, 2, ne_a, ta, sizeof ta);
    unsigned char q[18 * 2 * 3];
    for (size_t i = 0; i < sizeof q; i++)
        q[i] = (unsigned char)(i ^ 0x5a);
    uint64_t ne_q[4] = {64, 1, 3, 1};
    m40_gguf_writer_add_tensor(w, "q", M40_TYPE_Q4_0, 4, ne_q, q, sizeof q);
    uint16_t h[7] = {1, 2, 3, 4, 5, 6, 7};
    uint64_t ne_h[1] = {7};
    m40_gguf_writer_add_tensor(w, "h", M40_TYPE_F16, 1, ne_h, h, sizeof h);

    /* writer-side validation: these must be refused, and the first error sticks */
    m40_gguf_writer *w2 = m40_gguf_writer_new();
    if (w2) {
        CHECK(m40_gguf_writer_set_u32(w2, "k", 1) == 0, "set k");
        CHECK(m40_gguf_writer_set_u32(w2, "k", 2) == -1, "duplicate key accepted by writer");
        CHECK(m40_gguf_writer_error(w2) && strstr(m40_gguf_writer_error(w2), "duplicate"), "writer error text");
        CHECK(m40_gguf_writer_add_tensor(w2, "x", M40_TYPE_F32, 1, ne_h, h, 3) == -1, "wrong nbytes accepted");
        CHECK(m40_gguf_writer_add_tensor(w2, "y", M40_TYPE_Q8_0, 1, ne_h, NULL, 7) == -1, "partial block accepted");
        void *b;
        size_t bl;
        char err[256];
        CHECK(m40_gguf_writer_write_mem(w2, &b, &bl, err, sizeof err) == -1 && strstr(err, "duplicate"),
              "write after error must fail with the first error: %s", err);
        m40_gguf_writer_free(w2);
    }

    CHECK(m40_gguf_writer_error(w) == NULL, "writer error: %s", m40_gguf_writer_error(w));
    void *buf = NULL;
    size_t len = 0;
    char err[512];
    CHECK(m40_gguf_writer_write_mem(w, &buf, &len, err, sizeof err) == 0, "write_mem: %s", err);
    char path[] = "/tmp/m40_test_gguf_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    if (fd >= 0)
        close(fd);
    CHECK(fd >= 0 && m40_gguf_writer_write_file(w, path, err, sizeof err) == 0, "write_file: %s", err);
    m40_gguf_writer_free(w);
    if (!buf)
        return;

    for (int pass = 0; pass < 2; pass++) {
        m40_gguf *g = NULL;
        int rc = pass == 0 ? m40_gguf_open_mem(buf, len, &g, err, sizeof err) : m40_gguf_open(path, &g, err, sizeof err);
        CHECK(rc == 0, "pass %d: reopen: %s", pass, err);
        if (rc)
            continue;
        CHECK(m40_gguf_file_size(g) == len, "file and memory output differ in size");
        CHECK(m40_gguf_version(g) == 3 && m40_gguf_alignment(g) == 64, "version/alignment");
        CHECK(m40_gguf_n_kv(g) == 25 && m40_gguf_n_tensors(g) == 3, "counts %llu %llu",
              (unsigned long long)m40_gguf_n_kv(g), (unsigned long long)m40_gguf_n_tensors(g));
        CHECK(!strcmp(m40_gguf_kv_at(g, 1)->key, "t.u8") && m40_gguf_kv_at(g, 25) == NULL, "kv order");
        uint32_t u;
        int64_t i;
        float fv;
        int b;
        CHECK(m40_gguf_get_u32(g, "t.u8", &u) == 0 && u == 255, "u8");
        CHECK(m40_gguf_get_i64(g, "t.i8", &i) == 0 && i == -128, "i8");
        CHECK(m40_gguf_get_u32(g, "t.u16", &u) == 0 && u == 65535, "u16");
        CHECK(m40_gguf_get_i64(g, "t.i16", &i) == 0 && i == -32768, "i16");
        CHECK(m40_gguf_get_u32(g, "t.u32", &u) == 0 && u == UINT32_MAX, "u32");
        CHECK(m40_gguf_get_i64(g, "t.i32", &i) == 0 && i == INT32_MIN, "i32");
        CHECK(m40_gguf_get(g, "t.u64")->v.u64 == UINT64_MAX, "u64");
        CHECK(m40_gguf_get_i64(g, "t.i64", &i) == 0 && i == INT64_MIN, "i64");
        CHECK(m40_gguf_get_f32(g, "t.f32", &fv) == 0 && fv == 1.25f, "f32");
        CHECK(m40_gguf_get(g, "t.f64")->v.f64 == 3.141592653589793, "f64 exact");
        CHECK(m40_gguf_get_bool(g, "t.true", &b) == 0 && b == 1, "bool true");
        CHECK(m40_gguf_get_bool(g, "t.false", &b) == 0 && b == 0, "bool false");
        CHECK(!strcmp(m40_gguf_get_str(g, "t.str"), "héllo"), "string");
        CHECK(m40_gguf_get_str(g, "t.empty") && !*m40_gguf_get_str(g, "t.empty"), "empty string");
        const m40_gguf_value *nul = m40_gguf_get(g, "t.nul");
        CHECK(nul && nul->v.str.len == 3 && !memcmp(nul->v.str.ptr, "a\0b", 4), "string with NUL");
        /* range rules of the typed getters */
        CHECK(m40_gguf_get_u32(g, "t.u64", &u) == -1, "u64 max read as u32");
        CHECK(m40_gguf_get_i64(g, "t.u64", &i) == -1, "u64 max read as i64");
        CHECK(m40_gguf_get_u32(g, "t.i8", &u) == -1, "negative read as u32");
        CHECK(m40_gguf_get_f32(g, "t.i16", &fv) == 0 && fv == -32768.0f, "integer read as f32");
        CHECK(m40_gguf_get_bool(g, "t.u8", &b) == -1, "u8 read as bool");
        CHECK(m40_gguf_get_u32(g, "t.f32", &u) == -1, "float read as u32");
        const m40_gguf_value *a = m40_gguf_get_arr(g, "t.arr_f32", M40_GGUF_FLOAT32);
        CHECK(a && a->v.arr.n == 3 && a->v.arr.items[2].v.f64 == 1e30f && a->v.arr.items[1].v.f64 == -2.0, "arr f32");
        a = m40_gguf_get_arr(g, "t.arr_i32", M40_GGUF_INT32);
        CHECK(a && a->v.arr.n == 4 && a->v.arr.items[1].v.i64 == -1 && a->v.arr.items[3].v.i64 == INT32_MIN,
              "arr i32");
        a = m40_gguf_get_arr(g, "t.arr_bool", M40_GGUF_BOOL);
        CHECK(a && a->v.arr.n == 3 && a->v.arr.items[0].v.b == 1 && a->v.arr.items[1].v.b == 0, "arr bool");
        a = m40_gguf_get_arr(g, "t.arr_u64", M40_GGUF_UINT64);
        CHECK(a && a->v.arr.items[0].v.u64 == UINT64_MAX && a->v.arr.items[1].v.u64 == 42, "arr u64");
        a = m40_gguf_get_arr(g, "t.arr_i16", M40_GGUF_INT16);
        CHECK(a && a->v.arr.items[0].v.i64 == -5 && a->v.arr.items[1].v.i64 == 300, "arr i16");
        a = m40_gguf_get_arr(g, "t.arr_f64", M40_GGUF_FLOAT64);
        CHECK(a && a->v.arr.items[0].v.f64 == -0.5, "arr f64");
        a = m40_gguf_get_arr(g, "t.arr_empty", M40_GGUF_UINT8);
        CHECK(a && a->v.arr.n == 0, "empty array");
        a = m40_gguf_get_arr(g, "t.arr_str", M40_GGUF_STRING);
        CHECK(a && a->v.arr.n == 3 && !strcmp(a->v.arr.items[2].v.str.ptr, "longer string") &&
                  a->v.arr.items[1].v.str.len == 0,
              "arr str");
        a = m40_gguf_get_arr(g, "t.nested", M40_GGUF_ARRAY);
        CHECK(a && a->v.arr.n == 3 && a->v.arr.items[0].v.arr.type == M40_GGUF_STRING &&
                  a->v.arr.items[0].v.arr.n == 2 && !strcmp(a->v.arr.items[0].v.arr.items[1].v.str.ptr, "bc") &&
                  a->v.arr.items[1].v.arr.n == 0 && !strcmp(a->v.arr.items[2].v.arr.items[0].v.str.ptr, "d"),
              "nested array");
        const m40_gguf_tensor *t = m40_gguf_find_tensor(g, "a");
        CHECK(t && t->n_dims == 2 && t->ne[0] == 4 && t->ne[1] == 3 && t->nbytes == sizeof ta &&
                  !memcmp(t->data, ta, sizeof ta),
              "tensor a");
        t = m40_gguf_find_tensor(g, "q");
        CHECK(t && t->type == M40_TYPE_Q4_0 && t->n_dims == 4 && t->ne[2] == 3 && t->n_elems == 192 &&
                  t->nbytes == sizeof q && !memcmp(t->data, q, sizeof q),
              "tensor q");
        t = m40_gguf_find_tensor(g, "h");
        CHECK(t && t->type == M40_TYPE_F16 && !memcmp(t->data, h, sizeof h), "tensor h");
        int aligned = 1;
        for (uint64_t k = 0; k < m40_gguf_n_tensors(g); k++)
            aligned &= (m40_gguf_data_offset(g) + m40_gguf_tensor_at(g, k)->offset) % 64 == 0;
        CHECK(aligned, "tensor offsets aligned to 64");
        CHECK(m40_gguf_find_tensor(g, "nope") == NULL, "absent tensor found");
        CHECK(m40_gguf_get(g, "nope") == NULL, "absent key found");
        m40_gguf_close(g);
    }
    unlink(path);
    free(buf);
}

/* A 262k-entry vocabulary: the shape of real Gemma-size vocabularies. */
static void test_big_vocab(void)
{
    enum { N = 262144 };
    char *store = malloc((size_t)N * 16);
    const char **toks = malloc(N * sizeof *toks);
    m40_gguf_writer *w = m40_gguf_writer_new();
    if (!store || !toks || !w) {
        CHECK(0, "test: out of memory");
        free(store), free(toks), m40_gguf_writer_free(w);
        return;
    }
    for (int i = 0; i < N; i++) {
        snprintf(store + (size_t)i * 16, 16, "tok%d", i);
        toks[i] = store + (size_t)i * 16;
    }
    m40_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, N);
    void *buf;
    size_t len;
    char err[256];
    m40_gguf *g = NULL;
    CHECK(m40_gguf_writer_write_mem(w, &buf, &len, err, sizeof err) == 0, "write: %s", err);
    if (buf && m40_gguf_open_mem(buf, len, &g, err, sizeof err) == 0) {
        const m40_gguf_value *a = m40_gguf_get_arr(g, "tokenizer.ggml.tokens", M40_GGUF_STRING);
        CHECK(a && a->v.arr.n == N && !strcmp(a->v.arr.items[N - 1].v.str.ptr, "tok262143") &&
                  !strcmp(a->v.arr.items[1000].v.str.ptr, "tok1000"),
              "big vocab content");
        m40_gguf_close(g);
    } else {
        CHECK(0, "big vocab open: %s", err);
    }
    free(buf);
    m40_gguf_writer_free(w);
    free(store);
    free(toks);
}

/* ---------- (3) hostile files ---------- */

static void test_truncations(const unsigned char *base, size_t len)
{
    int not_failed = 0, no_message = 0, odd_message = 0;
    char err[512], first_odd[600] = "";
    /* the padding after the last tensor's data is optional: a file cut there is
     * still complete, a file cut anywhere before is not */
    size_t end = 0;
    m40_gguf *g0;
    if (m40_gguf_open_mem(base, len, &g0, err, sizeof err) == 0) {
        for (uint64_t i = 0; i < m40_gguf_n_tensors(g0); i++) {
            const m40_gguf_tensor *t = m40_gguf_tensor_at(g0, i);
            if (m40_gguf_data_offset(g0) + t->offset + t->nbytes > end)
                end = (size_t)(m40_gguf_data_offset(g0) + t->offset + t->nbytes);
        }
        m40_gguf_close(g0);
    }
    CHECK(end > 0 && end < len, "base file layout: data ends at %zu of %zu", end, len);
    for (size_t n = end; n < len; n++)
        expect_ok("cut in the trailing padding", base, n);
    for (size_t n = 0; n < end; n++) {
        m40_gguf *g = NULL;
        err[0] = 0;
        int rc = open_copy(base, n, &g, err, sizeof err);
        if (rc != -1)
            not_failed++;
        else if (!err[0])
            no_message++;
        else if (!strstr(err, "truncated") && !strstr(err, "past end") && !strstr(err, "impossible")) {
            if (!odd_message++)
                snprintf(first_odd, sizeof first_odd, "at %zu: %s", n, err);
        }
    }
    CHECK(not_failed == 0, "%d truncated files were accepted", not_failed);
    CHECK(no_message == 0, "%d truncations failed without a message", no_message);
    CHECK(odd_message == 0, "%d truncations gave a message not saying so, first %s", odd_message, first_odd);
    expect_ok("untruncated base", base, len);

    /* a cut inside the vocabulary names the key, the item and the offset */
    const unsigned char *p = memmem(base, len, "tokenXYZ", 8);
    CHECK(p != NULL, "token not found in base");
    if (p) {
        m40_gguf *g;
        open_copy(base, (size_t)(p - base) + 3, &g, err, sizeof err);
        CHECK(strstr(err, "truncated") && strstr(err, "('tokenizer.ggml.tokens') array item 5") &&
                  strstr(err, "offset"),
              "message: %s", err);
    }
}

static void test_hostile(const unsigned char *base, size_t len)
{
    unsigned char *b = malloc(len);
    if (!b) {
        CHECK(0, "test: out of memory");
        return;
    }
#define RESET() memcpy(b, base, len)
    size_t tok_key = after_string(base, len, "tokenizer.ggml.tokens");
    size_t name_key = after_string(base, len, "general.name");
    size_t alpha = after_string(base, len, "tensor_alpha");
    size_t q8 = after_string(base, len, "tensor_q8");
    size_t bbbb = after_string(base, len, "tensor_bbbb");
    size_t dup2 = after_string(base, len, "dup.key2");
    size_t flag = after_string(base, len, "flag.value");
    size_t nested = after_string(base, len, "nested.arr");
    CHECK(tok_key && name_key && alpha && q8 && bbbb && dup2 && flag && nested, "landmarks not found in base");
    if (!(tok_key && name_key && alpha && q8 && bbbb && dup2 && flag && nested)) {
        free(b);
        return;
    }

    RESET(), b[0] = 'X';
    expect_fail("bad magic", b, len, "magic");
    RESET(), put_u32(b + 4, 1);
    expect_fail("version 1", b, len, "version 1");
    RESET(), put_u32(b + 4, 99);
    expect_fail("version 99", b, len, "version 99");
    RESET(), put_u32(b + 4, 0x03000000);
    expect_fail("big-endian", b, len, "big-endian");
    RESET(), put_u64(b + 8, (uint64_t)1 << 63);
    expect_fail("huge n_tensors", b, len, "tensor count");
    RESET(), put_u64(b + 16, (uint64_t)1 << 63);
    expect_fail("huge n_kv", b, len, "kv count");
    RESET(), put_u64(b + 16, UINT64_MAX);
    expect_fail("n_kv 2^64-1", b, len, "kv count");
    RESET(), put_u64(b + 24, (uint64_t)1 << 62);
    expect_fail("huge key length", b, len, "key of");
    RESET(), put_u64(b + name_key + 4, (uint64_t)1 << 63);
    expect_fail("huge string length", b, len, "string of");
    RESET(), put_u64(b + tok_key + 8, (uint64_t)1 << 60);
    expect_fail("huge array count", b, len, "array count");
    RESET(), put_u64(b + tok_key + 8, 1000);
    expect_fail("array count past the data", b, len, "truncated");
    RESET(), put_u32(b + tok_key + 4, 13);
    expect_fail("unknown array element type", b, len, "element type");
    RESET(), put_u32(b + name_key, 13);
    expect_fail("unknown value type", b, len, "unknown value type 13");
    RESET(), b[flag + 4] = 2;
    expect_fail("bool value 2", b, len, "bool");
    RESET(), memcpy(b + dup2 - 8, "dup.key1", 8);
    expect_fail("duplicate key", b, len, "duplicate key 'dup.key1'");
    RESET(), b[dup2 - 2] = 0;
    expect_fail("NUL in key", b, len, "NUL");
    /* nested.arr is [[1,2],[3]]: claim the outer items are arrays of arrays */
    RESET(), put_u32(b + nested + 16, 13);
    expect_fail("unknown nested element type", b, len, "array item 0");

    RESET(), put_u32(b + alpha, 0);
    expect_fail("n_dims 0", b, len, "n_dims 0");
    RESET(), put_u32(b + alpha, 5);
    expect_fail("n_dims 5", b, len, "n_dims 5");
    RESET(), put_u64(b + alpha + 4, 0);
    expect_fail("ne 0", b, len, "zero");
    RESET(), put_u64(b + alpha + 4, (uint64_t)1 << 40), put_u64(b + alpha + 12, (uint64_t)1 << 40);
    expect_fail("ne product overflow", b, len, "overflow");
    RESET(), put_u32(b + alpha + 20, 99);
    expect_fail("unknown type id 99", b, len, "unknown type");
    RESET(), put_u32(b + alpha + 20, 4); /* a retired ggml type number */
    expect_fail("unknown type id 4", b, len, "unknown type");
    RESET(), put_u64(b + q8 + 4, 33);
    expect_fail("partial block", b, len, "block size");
    RESET(), put_u64(b + alpha + 24, (uint64_t)1 << 20);
    expect_fail("offset past end", b, len, "past end of file");
    RESET(), put_u64(b + alpha + 24, 4);
    expect_fail("misaligned offset", b, len, "not aligned");
    RESET(), put_u64(b + alpha + 24, UINT64_MAX - 31);
    expect_fail("offset overflow", b, len, "overflow");
    RESET(), b[bbbb - 1] = 0;
    expect_fail("NUL in tensor name", b, len, "NUL");
    free(b);

    /* duplicate tensor names and bad alignments are built with the writer */
    m40_gguf_writer *w;
    void *out;
    size_t olen;
    char err[256];
    uint64_t ne[1] = {8};
    float z[8] = {0};
    const struct {
        const char *what;
        int kind; /* 0 alignment value, 1 alignment type */
        uint32_t align;
        const char *want;
    } al[] = {{"alignment 0", 0, 0, "alignment is 0"}, {"alignment 3", 0, 3, "not a power of two"},
              {"alignment as string", 1, 0, "general.alignment has type string"}};
    for (size_t k = 0; k < sizeof al / sizeof al[0]; k++) {
        w = m40_gguf_writer_new();
        if (al[k].kind == 0)
            m40_gguf_writer_set_u32(w, "general.alignment", al[k].align);
        else
            m40_gguf_writer_set_str(w, "general.alignment", "32");
        m40_gguf_writer_add_tensor(w, "t", M40_TYPE_F32, 1, ne, z, sizeof z);
        if (m40_gguf_writer_write_mem(w, &out, &olen, err, sizeof err) == 0) {
            expect_fail(al[k].what, out, olen, al[k].want);
            free(out);
        } else {
            CHECK(0, "%s: writer: %s", al[k].what, err);
        }
        m40_gguf_writer_free(w);
    }

    w = m40_gguf_writer_new();
    m40_gguf_writer_add_tensor(w, "same_aa", M40_TYPE_F32, 1, ne, z, sizeof z);
    m40_gguf_writer_add_tensor(w, "same_bb", M40_TYPE_F32, 1, ne, z, sizeof z);
    if (m40_gguf_writer_write_mem(w, &out, &olen, err, sizeof err) == 0) {
        size_t at = after_string(out, olen, "same_bb");
        CHECK(at > 0, "tensor name not found");
        if (at) {
            memcpy((char *)out + at - 2, "aa", 2);
            expect_fail("duplicate tensor name", out, olen, "duplicate tensor name 'same_aa'");
        }
        free(out);
    }
    m40_gguf_writer_free(w);

    /* nesting: 8 levels are fine, 9 are refused */
    for (int depth = 8; depth <= 9; depth++) {
        m40_gguf_value lv[10];
        lv[0].type = M40_GGUF_UINT8;
        lv[0].v.u64 = 1;
        for (int d = 1; d <= depth; d++) {
            lv[d].type = M40_GGUF_ARRAY;
            lv[d].v.arr.type = lv[d - 1].type;
            lv[d].v.arr.n = 1;
            lv[d].v.arr.items = &lv[d - 1];
        }
        w = m40_gguf_writer_new();
        m40_gguf_writer_set_value(w, "deep", &lv[depth]);
        if (m40_gguf_writer_write_mem(w, &out, &olen, err, sizeof err) == 0) {
            if (depth == 8)
                expect_ok("8 nested arrays", out, olen);
            else
                expect_fail("9 nested arrays", out, olen, "nested deeper");
            free(out);
        } else {
            CHECK(0, "nesting %d: writer: %s", depth, err);
        }
        m40_gguf_writer_free(w);
    }

    /* files on disk: absent path, directory, tiny file */
    m40_gguf *g;
    CHECK(m40_gguf_open("/nonexistent/m40.gguf", &g, err, sizeof err) == -1 && strstr(err, "cannot open") &&
              g == NULL,
          "absent file: %s", err);
    CHECK(m40_gguf_open("/tmp", &g, err, sizeof err) == -1 && strstr(err, "not a regular file"), "directory: %s",
          err);
}

/* ---------- (4) random byte flips ---------- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void test_flips(const unsigned char *base, size_t len)
{
    /* flips are aimed at the metadata (where parsing decisions are made) 7 times in 8 */
    char err[512];
    m40_gguf *g;
    size_t meta = len;
    if (m40_gguf_open_mem(base, len, &g, err, sizeof err) == 0) {
        meta = (size_t)m40_gguf_data_offset(g);
        m40_gguf_close(g);
    }
    int opened = 0, failed = 0, silent = 0;
    unsigned char *b = malloc(len);
    if (!b) {
        CHECK(0, "test: out of memory");
        return;
    }
    for (int it = 0; it < 4000; it++) {
        memcpy(b, base, len);
        int nflips = 1 + (int)(rng() % 4);
        for (int k = 0; k < nflips; k++) {
            size_t at = (rng() % 8) ? rng() % meta : rng() % len;
            b[at] = (rng() % 2) ? (unsigned char)rng() : (unsigned char)(b[at] ^ (1u << (rng() % 8)));
        }
        err[0] = 0;
        if (m40_gguf_open_mem(b, len, &g, err, sizeof err) == 0) {
            /* whatever was accepted must be walkable within the buffer */
            volatile unsigned sum = 0;
            for (uint64_t i = 0; i < m40_gguf_n_kv(g); i++) {
                const m40_gguf_kv *kv = m40_gguf_kv_at(g, i);
                sum += (unsigned)strlen(kv->key);
                if (kv->value.type == M40_GGUF_STRING)
                    sum += (unsigned)strlen(kv->value.v.str.ptr);
            }
            for (uint64_t i = 0; i < m40_gguf_n_tensors(g); i++) {
                const m40_gguf_tensor *t = m40_gguf_tensor_at(g, i);
                const unsigned char *d = t->data;
                sum += d[0] + d[t->nbytes - 1];
                sum += m40_gguf_find_tensor(g, t->name) == t;
            }
            (void)sum;
            m40_gguf_close(g);
            opened++;
        } else {
            failed++;
            silent += !err[0];
        }
    }
    free(b);
    CHECK(failed > 1000, "only %d of 4000 corrupted files were rejected", failed);
    CHECK(silent == 0, "%d rejections without a message", silent);
    printf("byte flips: %d accepted, %d rejected\n", opened, failed);
}

int main(void)
{
    test_shared_dir("models", 1);
    test_shared_dir("tokenizer", 0);
    test_stories();
    test_qwen();
    test_q4km();
    test_roundtrip();
    test_big_vocab();

    size_t len = 0;
    unsigned char *base = build_base(&len);
    CHECK(base != NULL, "could not build the base file");
    if (base) {
        test_truncations(base, len);
        test_hostile(base, len);
        test_flips(base, len);
        free(base);
    }
    return check_done();
}
