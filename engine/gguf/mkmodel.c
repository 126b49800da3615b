/* Synthetic GGUF models (mkmodel.h): shapes, the type recipe, the vocabulary, the
 * metadata serializer and the streaming, multithreaded tensor writer.
 *
 * gguf_writer.h keeps every tensor in memory until it writes the file, which a 14.5 GB
 * model cannot afford, so this file lays GGUF v3 out itself: header, kv section and
 * tensor infos are serialized into one buffer with every tensor's offset computed up
 * front; the file is then reserved (fallocate, which never emulates by writing zeros)
 * and sized (ftruncate: alignment padding reads as zeros) and each worker generates, quantizes and pwrites its own row chunk. */
#include "mkmodel.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "ref/ggml_types.h"
#include "gguf.h"
#include "ref/quant.h"
#include "util/hash.h"
#include "util/threadpool.h"

#define MK_ALIGNMENT 32
#define MK_CHUNK_ELEMS (1 << 18) /* elements generated per task: 1 MB of floats per thread */
#define MK_INIT_STD 0.02f

/* ---------- shapes ---------- */

/* Mistral 7B is v0.1: rope base 10000 (v0.2 moved to 1e6), context 32768 as its
 * config.json and the usual GGUF conversions state (sliding window 4096 is not a
 * GGUF key the llama architecture has). */
static const m40_mkmodel_shape shapes[] = {
    {"tiny", "test shape: 2 layers of dim 256, GQA 4:2", 256, 2, 4, 2, 768, 1024, 512, 10000.0f, 1e-5f, NULL, 0, 0, 0,
     0, 0},
    {"tiny-tp", "test shape: 8 heads, 4 KV heads, Q4_K-aligned splits over 2 or 4 tensor-parallel ranks", 1024, 2, 8,
     4, 4096, 1024, 512, 10000.0f, 1e-5f, NULL, 0, 0, 0, 0, 0},
    {"tinyllama-1.1b", "TinyLlama 1.1B", 2048, 22, 32, 4, 5632, 32000, 2048, 10000.0f, 1e-5f, NULL, 0, 0, 0, 0, 0},
    {"llama-2-7b", "Llama 2 7B", 4096, 32, 32, 32, 11008, 32000, 4096, 10000.0f, 1e-5f, NULL, 0, 0, 0, 0, 0},
    {"mistral-7b", "Mistral 7B v0.1", 4096, 32, 32, 8, 14336, 32000, 32768, 10000.0f, 1e-5f, NULL, 0, 0, 0, 0, 0},
    {"llama-3-8b", "Llama 3 8B (SentencePiece-style vocabulary of its size)", 4096, 32, 32, 8, 14336, 128256,
     8192, 500000.0f, 1e-5f, NULL, 0, 0, 0, 0, 0},
    {"llama-3-70b", "Llama 3 70B (SentencePiece-style vocabulary of its size): tensor parallelism's shape", 8192, 80,
     64, 8, 28672, 128256, 8192, 500000.0f, 1e-5f, NULL, 0, 0, 0, 0, 0},
    /* The other architectures, each with a tiny test shape for CPU smoke tests, and the
     * real sizes from their config.json (vocabularies are SentencePiece-style of the
     * real size; heads of Qwen3 and Gemma 2 are key_length wide, not dim / heads). */
    {"tiny-qwen3", "test shape: qwen3, head_dim 128 != 256 / 4", 256, 2, 4, 2, 768, 1024, 512, 1e6f, 1e-6f, "qwen3",
     128, 0, 0, 0, 0},
    {"tiny-phi3", "test shape: phi3, fused attn_qkv and gate+up", 256, 2, 4, 2, 768, 1024, 512, 10000.0f, 1e-5f,
     "phi3", 0, 0, 0, 0, 0},
    {"tiny-gemma2", "test shape: gemma2, window 8, tied head", 256, 2, 4, 2, 768, 1024, 512, 10000.0f, 1e-6f,
     "gemma2", 64, 8, 0, 0, 0},
    {"qwen3-8b", "Qwen3 8B (head_dim 128)", 4096, 36, 32, 8, 12288, 151936, 40960, 1e6f, 1e-6f, "qwen3", 128, 0, 0,
     0, 0},
    {"qwen3-32b", "Qwen3 32B (head_dim 128)", 5120, 64, 64, 8, 25600, 151936, 40960, 1e6f, 1e-6f, "qwen3", 128, 0, 0,
     0, 0},
    {"phi-4", "Phi-4 14B (GGUF architecture phi3)", 5120, 40, 40, 10, 17920, 100352, 16384, 250000.0f, 1e-5f, "phi3",
     0, 0, 0, 0, 0},
    {"gemma2-9b", "Gemma 2 9B (head_dim 256, window 4096, tied head)", 3584, 42, 16, 8, 14336, 256000, 8192,
     10000.0f, 1e-6f, "gemma2", 256, 4096, 0, 0, 0},
    /* Mixtures of experts: ffn_dim is the dense feed_forward_length the real files
     * store (unused by these graphs); the experts' width is the last field. */
    {"tiny-qwen3moe", "test shape: qwen3moe, 8 experts, 2 used", 256, 2, 4, 2, 768, 1024, 512, 1e6f, 1e-6f,
     "qwen3moe", 64, 0, 8, 2, 256},
    {"tiny-gpt-oss", "test shape: gpt-oss, window 8, 8 experts, 4 used", 256, 2, 4, 2, 256, 1024, 4096, 150000.0f,
     1e-5f, "gpt-oss", 64, 8, 8, 4, 256},
    {"qwen3-30b-a3b", "Qwen3-30B-A3B (128 experts, 8 used, expert ffn 768)", 2048, 48, 32, 4, 6144, 151936, 40960,
     1e6f, 1e-6f, "qwen3moe", 128, 0, 128, 8, 768},
    {"gpt-oss-20b", "gpt-oss-20b (32 experts, 4 used, window 128; --type MXFP4)", 2880, 24, 64, 8, 2880, 201088,
     131072, 150000.0f, 1e-5f, "gpt-oss", 64, 128, 32, 4, 2880},
};

static const char *shape_arch(const m40_mkmodel_shape *s) { return s->arch ? s->arch : "llama"; }
static int32_t shape_head_dim(const m40_mkmodel_shape *s)
{
    return s->head_dim ? s->head_dim : s->dim / s->n_heads;
}

const m40_mkmodel_shape *m40_mkmodel_shape_at(int i)
{
    return i >= 0 && i < (int)(sizeof shapes / sizeof shapes[0]) ? &shapes[i] : NULL;
}

const m40_mkmodel_shape *m40_mkmodel_find_shape(const char *name)
{
    for (int i = 0; m40_mkmodel_shape_at(i); i++)
        if (!strcmp(shapes[i].name, name))
            return &shapes[i];
    return NULL;
}

/* ---------- types and the recipe ---------- */

static const struct {
    const char *name;
    m40_mkmodel_ftype ft;
} ftypes[] = {
    {"F32", M40_MK_F32}, {"F16", M40_MK_F16}, {"BF16", M40_MK_BF16}, {"Q8_0", M40_MK_Q8_0},
    {"Q6_K", M40_MK_Q6_K}, {"Q4_K_M", M40_MK_Q4_K_M}, {"Q4_0", M40_MK_Q4_0}, {"MXFP4", M40_MK_MXFP4},
};
#define N_FTYPES (sizeof ftypes / sizeof ftypes[0])

int m40_mkmodel_parse_type(const char *name, m40_mkmodel_ftype *out)
{
    for (size_t i = 0; i < N_FTYPES; i++)
        if (!strcasecmp(ftypes[i].name, name)) {
            *out = ftypes[i].ft;
            return 0;
        }
    return -1;
}

const char *m40_mkmodel_type_name(m40_mkmodel_ftype t)
{
    for (size_t i = 0; i < N_FTYPES; i++)
        if (ftypes[i].ft == t)
            return ftypes[i].name;
    return "unknown";
}

const char *m40_mkmodel_type_list(void)
{
    return "F32, F16, BF16, Q8_0, Q6_K, Q4_K_M, Q4_0, MXFP4";
}

int m40_mkmodel_more_bits(int32_t layer, int32_t n_layers)
{
    int32_t e = n_layers / 8;
    return layer < e || layer >= 7 * n_layers / 8 || (layer - e) % 3 == 2;
}

uint32_t m40_mkmodel_tensor_type(m40_mkmodel_ftype ft, const char *name, int32_t n_layers)
{
    if (strstr(name, "norm") || strstr(name, ".bias") || strstr(name, "attn_sinks") || strstr(name, "ffn_gate_inp"))
        return M40_TYPE_F32;
    int is_output = !strcmp(name, "output.weight");
    switch (ft) {
    case M40_MK_MXFP4: return strstr(name, "_exps.") ? M40_TYPE_MXFP4 : M40_TYPE_Q8_0;
    case M40_MK_F32: return M40_TYPE_F32;
    case M40_MK_F16: return M40_TYPE_F16;
    case M40_MK_BF16: return M40_TYPE_BF16;
    case M40_MK_Q8_0: return M40_TYPE_Q8_0;
    case M40_MK_Q6_K: return M40_TYPE_Q6_K;
    case M40_MK_Q4_0: return is_output ? M40_TYPE_Q6_K : M40_TYPE_Q4_0;
    case M40_MK_Q4_K_M: {
        if (is_output)
            return M40_TYPE_Q6_K;
        int layer;
        char rest[64];
        if (sscanf(name, "blk.%d.%63s", &layer, rest) == 2 &&
            (!strcmp(rest, "attn_v.weight") || !strcmp(rest, "ffn_down.weight") ||
             !strcmp(rest, "ffn_down_exps.weight")) &&
            m40_mkmodel_more_bits(layer, n_layers))
            return M40_TYPE_Q6_K;
        return M40_TYPE_Q4_K;
    }
    }
    return M40_TYPE_F32;
}

/* ---------- random numbers ---------- */

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t rotl64(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

typedef struct {
    uint64_t s[4];
} xoshiro256;

static inline uint64_t xoshiro_next(xoshiro256 *r)
{
    uint64_t *s = r->s;
    uint64_t out = rotl64(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl64(s[3], 45);
    return out;
}

/* One independent stream per (seed, tensor, row). */
static void row_rng(xoshiro256 *r, uint64_t seed, uint64_t name_hash, uint64_t row)
{
    uint64_t x = seed;
    x = splitmix64(&x) ^ name_hash;
    x = splitmix64(&x) ^ row;
    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix64(&x);
}

static uint64_t fnv1a(const char *s) { return m40_fnv1a64(s, strlen(s)); }

/* n approximately normal values of standard deviation `std`: the sum of the four
 * 16-bit lanes of one 64-bit draw has mean 131070 and standard deviation
 * sqrt((65536^2 - 1) / 3). Integer sums and one float multiply: the same bits everywhere. */
static void fill_normal(xoshiro256 *r, float *x, int64_t n, float std)
{
    const float k = std / 37837.2273f;
    for (int64_t i = 0; i < n; i++) {
        uint64_t v = xoshiro_next(r);
        int32_t s = (int32_t)((v & 0xffff) + ((v >> 16) & 0xffff) + ((v >> 32) & 0xffff) + (v >> 48)) - 131070;
        x[i] = (float)s * k;
    }
}

/* ---------- byte buffer and GGUF serialization ---------- */

typedef struct {
    unsigned char *p;
    size_t len, cap;
    int oom;
    uint64_t n_kv;
} bytebuf;

static void bb_put(bytebuf *b, const void *data, size_t n)
{
    if (b->oom)
        return;
    if (n > b->cap - b->len) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap - b->len < n)
            cap *= 2;
        unsigned char *np = realloc(b->p, cap);
        if (!np) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->len, data, n);
    b->len += n;
}

static void bb_le(bytebuf *b, uint64_t v, int n)
{
    unsigned char t[8];
    for (int i = 0; i < n; i++)
        t[i] = (unsigned char)(v >> (8 * i));
    bb_put(b, t, (size_t)n);
}

static void bb_str(bytebuf *b, const char *s, size_t n)
{
    bb_le(b, n, 8);
    bb_put(b, s, n);
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static void kv_key(bytebuf *b, const char *key, m40_gguf_type t)
{
    bb_str(b, key, strlen(key));
    bb_le(b, (uint32_t)t, 4);
    b->n_kv++;
}

static void kv_u32(bytebuf *b, const char *key, uint32_t v)
{
    kv_key(b, key, M40_GGUF_UINT32);
    bb_le(b, v, 4);
}

static void kv_f32(bytebuf *b, const char *key, float v)
{
    kv_key(b, key, M40_GGUF_FLOAT32);
    bb_le(b, f32_bits(v), 4);
}

static void kv_bool(bytebuf *b, const char *key, int v)
{
    kv_key(b, key, M40_GGUF_BOOL);
    bb_le(b, v ? 1 : 0, 1);
}

static void kv_str(bytebuf *b, const char *key, const char *s)
{
    kv_key(b, key, M40_GGUF_STRING);
    bb_str(b, s, strlen(s));
}

static void kv_arr_head(bytebuf *b, const char *key, m40_gguf_type elem, uint64_t n)
{
    kv_key(b, key, M40_GGUF_ARRAY);
    bb_le(b, (uint32_t)elem, 4);
    bb_le(b, n, 8);
}

/* ---------- vocabulary ---------- */

/* SentencePiece-style "llama" vocabulary: <unk>, <s>, </s>, the 256 byte-fallback
 * pieces <0x00>..<0xFF>, single characters (word boundary U+2581, letters, digits,
 * punctuation), then lowercase strings by growing symbol count, "▁a".."▁z", "aa".."zz",
 * "▁aa".."▁zz", "aaa".."zzz", ... until the vocabulary is full (32000 ends among
 * "▁xyz", 128256 among four-letter strings). All pieces are distinct, and each multi-character piece is the
 * merge of two earlier ones, so SentencePiece's BPE encoder reaches them. Scores are
 * merge priorities (0 for special and byte pieces, then -1, -2, ... in order), as in
 * Llama's own vocabulary. */
#define SP_WORD "\xe2\x96\x81" /* U+2581 */

typedef struct {
    char *text;       /* pieces, NUL-separated */
    size_t *off;      /* n offsets into text */
    float *scores;
    int32_t *types;
    int32_t n;
} vocab;

static void vocab_free(vocab *v)
{
    free(v->text);
    free(v->off);
    free(v->scores);
    free(v->types);
}

static int vocab_add(vocab *v, size_t *used, size_t *cap, const char *piece, float score, int32_t type)
{
    size_t l = strlen(piece) + 1;
    if (*used + l > *cap) {
        size_t nc = *cap * 2 + l;
        char *nt = realloc(v->text, nc);
        if (!nt)
            return -1;
        v->text = nt;
        *cap = nc;
    }
    memcpy(v->text + *used, piece, l);
    v->off[v->n] = *used;
    v->scores[v->n] = score;
    v->types[v->n] = type;
    v->n++;
    *used += l;
    return 0;
}

static int vocab_build(vocab *v, int32_t n_vocab)
{
    memset(v, 0, sizeof *v);
    size_t used = 0, cap = (size_t)n_vocab * 8;
    v->text = malloc(cap);
    v->off = malloc((size_t)n_vocab * sizeof *v->off);
    v->scores = malloc((size_t)n_vocab * sizeof *v->scores);
    v->types = malloc((size_t)n_vocab * sizeof *v->types);
    if (!v->text || !v->off || !v->scores || !v->types)
        return -1;
    static const char *special[] = {"<unk>", "<s>", "</s>"};
    static const int32_t special_type[] = {2, 3, 3}; /* UNKNOWN, CONTROL, CONTROL */
    char piece[64];
    for (int i = 0; i < 3 && v->n < n_vocab; i++)
        if (vocab_add(v, &used, &cap, special[i], 0.0f, special_type[i]))
            return -1;
    for (int b = 0; b < 256 && v->n < n_vocab; b++) {
        snprintf(piece, sizeof piece, "<0x%02X>", b);
        if (vocab_add(v, &used, &cap, piece, 0.0f, 6 /* BYTE */))
            return -1;
    }
    float score = 0.0f;
    static const char singles[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-:;()";
    if (v->n < n_vocab && vocab_add(v, &used, &cap, SP_WORD, score -= 1.0f, 1))
        return -1;
    for (const char *c = singles; *c && v->n < n_vocab; c++) {
        piece[0] = *c;
        piece[1] = 0;
        if (vocab_add(v, &used, &cap, piece, score -= 1.0f, 1))
            return -1;
    }
    /* lowercase strings as an odometer over a..z, by symbol count: "▁x", then "xy",
     * "▁xy", "xyz", "▁xyz", ... (each the merge of a piece one symbol shorter) */
    for (int k = 1; v->n < n_vocab && k < 15; k++) {
        for (int prefixed = 1; prefixed >= 0 && v->n < n_vocab; prefixed--) {
            int letters = prefixed ? k : k + 1, digit[16] = {0};
            for (;;) {
                size_t p = 0;
                if (prefixed) {
                    memcpy(piece, SP_WORD, 3);
                    p = 3;
                }
                for (int i = 0; i < letters; i++)
                    piece[p++] = (char)('a' + digit[i]);
                piece[p] = 0;
                if (v->n >= n_vocab)
                    break;
                if (vocab_add(v, &used, &cap, piece, score -= 1.0f, 1))
                    return -1;
                int i = letters - 1;
                while (i >= 0 && ++digit[i] == 26)
                    digit[i--] = 0;
                if (i < 0)
                    break;
            }
        }
    }
    return v->n == n_vocab ? 0 : -1;
}

/* ---------- the tensor plan ---------- */

typedef struct {
    char name[64];
    uint32_t type;
    uint32_t n_dims;
    uint64_t ne0, ne1;    /* row length, rows */
    uint64_t ne2;         /* matrices (experts), each of ne1 rows; 1 for 1-D and 2-D */
    uint64_t row_bytes, nbytes;
    uint64_t offset;      /* within the data section */
    uint64_t name_hash;
    float std;            /* 0: a norm, every element 1.0 */
} plan_tensor;

typedef struct {
    plan_tensor *t;
    size_t n, cap;
} plan;

static int plan_add3(plan *p, const m40_mkmodel_opts *o, int32_t n_layers, const char *name, uint64_t ne0,
                     uint64_t ne1, uint64_t ne2, float std, char *err, size_t errlen)
{
    if (p->n == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 64;
        plan_tensor *nt = realloc(p->t, cap * sizeof *nt);
        if (!nt) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
        p->t = nt;
        p->cap = cap;
    }
    plan_tensor *t = &p->t[p->n];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->type = m40_mkmodel_tensor_type(o->ftype, name, n_layers);
    t->n_dims = ne2 > 1 ? 3 : ne1 > 1 ? 2 : 1;
    t->ne0 = ne0;
    t->ne1 = ne1 * ne2; /* the generator's rows: every matrix's, one after the other */
    t->ne2 = ne2;
    t->std = std;
    t->name_hash = fnv1a(name);
    if (m40_type_nbytes(t->type, ne0, &t->row_bytes) != 0) {
        snprintf(err, errlen, "tensor %s: row length %llu is not a multiple of the %s block size", name,
                 (unsigned long long)ne0, m40_type_name(t->type));
        return -1;
    }
    t->nbytes = t->row_bytes * t->ne1;
    p->n++;
    return 0;
}

static int plan_add(plan *p, const m40_mkmodel_opts *o, int32_t n_layers, const char *name, uint64_t ne0,
                    uint64_t ne1, float std, char *err, size_t errlen)
{
    return plan_add3(p, o, n_layers, name, ne0, ne1, 1, std, err, errlen);
}

static int plan_build(plan *p, const m40_mkmodel_opts *o, int32_t L, char *err, size_t errlen)
{
    const m40_mkmodel_shape *s = o->shape;
    const char *arch = shape_arch(s);
    int qk_norm = !strcmp(arch, "qwen3") || !strcmp(arch, "qwen3moe"), fused = !strcmp(arch, "phi3"),
        gemma = !strcmp(arch, "gemma2"), oss = !strcmp(arch, "gpt-oss"), moe = s->n_experts > 0;
    uint64_t E = (uint64_t)s->n_experts, F = (uint64_t)s->expert_ffn_dim;
    uint64_t dim = (uint64_t)s->dim, hd = (uint64_t)shape_head_dim(s);
    uint64_t q_dim = hd * (uint64_t)s->n_heads, kv_dim = hd * (uint64_t)s->n_kv_heads, ffn = (uint64_t)s->ffn_dim;
    uint64_t vocab = (uint64_t)s->n_vocab;
    float branch_out = MK_INIT_STD / sqrtf(2.0f * (float)L);
    char n[64];
    memset(p, 0, sizeof *p);
    if (plan_add(p, o, L, "token_embd.weight", dim, vocab, MK_INIT_STD, err, errlen) ||
        plan_add(p, o, L, "output_norm.weight", dim, 1, 0.0f, err, errlen) ||
        (!gemma && plan_add(p, o, L, "output.weight", dim, vocab, MK_INIT_STD, err, errlen))) /* gemma2: tied */
        return -1;
#define BLK(suffix, ne0, ne1, std)                                                                   \
    (snprintf(n, sizeof n, "blk.%d.%s", (int)l, suffix), plan_add(p, o, L, n, ne0, ne1, std, err, errlen))
#define BLK3(suffix, ne0, ne1, ne2, std)                                                             \
    (snprintf(n, sizeof n, "blk.%d.%s", (int)l, suffix), plan_add3(p, o, L, n, ne0, ne1, ne2, std, err, errlen))
    for (int32_t l = 0; l < L; l++) {
        if (BLK("attn_norm.weight", dim, 1, 0.0f))
            return -1;
        if (fused ? BLK("attn_qkv.weight", dim, q_dim + 2 * kv_dim, MK_INIT_STD)
                  : BLK("attn_q.weight", dim, q_dim, MK_INIT_STD) || BLK("attn_k.weight", dim, kv_dim, MK_INIT_STD) ||
                        BLK("attn_v.weight", dim, kv_dim, MK_INIT_STD))
            return -1;
        if (qk_norm && (BLK("attn_q_norm.weight", hd, 1, 0.0f) || BLK("attn_k_norm.weight", hd, 1, 0.0f)))
            return -1;
        if (BLK("attn_output.weight", q_dim, dim, branch_out) ||
            (gemma && BLK("post_attention_norm.weight", dim, 1, 0.0f)))
            return -1;
        /* gpt-oss: biases everywhere, one sink logit per head, its FFN norm's name */
        if (oss && (BLK("attn_q.bias", q_dim, 1, MK_INIT_STD) || BLK("attn_k.bias", kv_dim, 1, MK_INIT_STD) ||
                    BLK("attn_v.bias", kv_dim, 1, MK_INIT_STD) || BLK("attn_output.bias", dim, 1, MK_INIT_STD) ||
                    BLK("attn_sinks.weight", (uint64_t)s->n_heads, 1, 1.0f)))
            return -1;
        if (BLK(oss ? "post_attention_norm.weight" : "ffn_norm.weight", dim, 1, 0.0f))
            return -1;
        if (moe) {
            if (BLK("ffn_gate_inp.weight", dim, E, MK_INIT_STD) ||
                BLK3("ffn_gate_exps.weight", dim, F, E, MK_INIT_STD) ||
                BLK3("ffn_up_exps.weight", dim, F, E, MK_INIT_STD) || BLK3("ffn_down_exps.weight", F, dim, E, branch_out))
                return -1;
            if (oss && (BLK("ffn_gate_inp.bias", E, 1, MK_INIT_STD) || BLK("ffn_gate_exps.bias", F, E, MK_INIT_STD) ||
                        BLK("ffn_up_exps.bias", F, E, MK_INIT_STD) || BLK("ffn_down_exps.bias", dim, E, MK_INIT_STD)))
                return -1;
            continue;
        }
        if (fused ? BLK("ffn_up.weight", dim, 2 * ffn, MK_INIT_STD)
                  : BLK("ffn_gate.weight", dim, ffn, MK_INIT_STD) || BLK("ffn_up.weight", dim, ffn, MK_INIT_STD))
            return -1;
        if (BLK("ffn_down.weight", ffn, dim, branch_out) || (gemma && BLK("post_ffw_norm.weight", dim, 1, 0.0f)))
            return -1;
    }
#undef BLK
#undef BLK3
    return 0;
}

/* ---------- header ---------- */

static int build_header(bytebuf *b, const m40_mkmodel_opts *o, int32_t L, plan *p, uint64_t *data_bytes,
                        char *err, size_t errlen)
{
    const m40_mkmodel_shape *s = o->shape;
    vocab v;
    if (vocab_build(&v, s->n_vocab) != 0) {
        vocab_free(&v);
        snprintf(err, errlen, "out of memory building a %d-piece vocabulary", (int)s->n_vocab);
        return -1;
    }
    bytebuf kv = {0};
    char name[160];
    snprintf(name, sizeof name, "%s %s (m40 synthetic, seed %llu)", s->name, m40_mkmodel_type_name(o->ftype),
             (unsigned long long)o->seed);
    const char *arch = shape_arch(s);
    char key[96];
#define AKEY(suffix) (snprintf(key, sizeof key, "%s.%s", arch, suffix), key)
    kv_str(&kv, "general.architecture", arch);
    kv_str(&kv, "general.name", name);
    kv_str(&kv, "general.description",
           "random weights in the shape of a real model, written by m40 mkmodel; not a trained model");
    kv_u32(&kv, "general.file_type", (uint32_t)o->ftype);
    kv_u32(&kv, "general.quantization_version", 2);
    kv_u32(&kv, "general.alignment", MK_ALIGNMENT);
    kv_u32(&kv, AKEY("context_length"), (uint32_t)s->ctx);
    kv_u32(&kv, AKEY("embedding_length"), (uint32_t)s->dim);
    kv_u32(&kv, AKEY("block_count"), (uint32_t)L);
    kv_u32(&kv, AKEY("feed_forward_length"), (uint32_t)s->ffn_dim);
    kv_u32(&kv, AKEY("rope.dimension_count"), (uint32_t)shape_head_dim(s));
    kv_u32(&kv, AKEY("attention.head_count"), (uint32_t)s->n_heads);
    kv_u32(&kv, AKEY("attention.head_count_kv"), (uint32_t)s->n_kv_heads);
    if (s->head_dim) {
        kv_u32(&kv, AKEY("attention.key_length"), (uint32_t)s->head_dim);
        kv_u32(&kv, AKEY("attention.value_length"), (uint32_t)s->head_dim);
    }
    if (s->window)
        kv_u32(&kv, AKEY("attention.sliding_window"), (uint32_t)s->window);
    if (!strcmp(arch, "gemma2")) {
        kv_f32(&kv, AKEY("attn_logit_softcapping"), 50.0f);
        kv_f32(&kv, AKEY("final_logit_softcapping"), 30.0f);
    }
    if (s->n_experts) {
        kv_u32(&kv, AKEY("expert_count"), (uint32_t)s->n_experts);
        kv_u32(&kv, AKEY("expert_used_count"), (uint32_t)s->n_experts_used);
        kv_u32(&kv, AKEY("expert_feed_forward_length"), (uint32_t)s->expert_ffn_dim);
    }
    if (!strcmp(arch, "gpt-oss")) { /* as gpt-oss-20b and -120b are published */
        kv_str(&kv, AKEY("rope.scaling.type"), "yarn");
        kv_f32(&kv, AKEY("rope.scaling.factor"), 32.0f);
        kv_u32(&kv, AKEY("rope.scaling.original_context_length"), 4096);
        kv_f32(&kv, AKEY("rope.scaling.yarn_beta_fast"), 32.0f);
        kv_f32(&kv, AKEY("rope.scaling.yarn_beta_slow"), 1.0f);
    }
    kv_f32(&kv, AKEY("attention.layer_norm_rms_epsilon"), s->norm_eps);
    kv_f32(&kv, AKEY("rope.freq_base"), s->rope_base);
    kv_u32(&kv, AKEY("vocab_size"), (uint32_t)s->n_vocab);
#undef AKEY
    kv_str(&kv, "tokenizer.ggml.model", "llama");
    kv_arr_head(&kv, "tokenizer.ggml.tokens", M40_GGUF_STRING, (uint64_t)v.n);
    for (int32_t i = 0; i < v.n; i++)
        bb_str(&kv, v.text + v.off[i], strlen(v.text + v.off[i]));
    kv_arr_head(&kv, "tokenizer.ggml.scores", M40_GGUF_FLOAT32, (uint64_t)v.n);
    for (int32_t i = 0; i < v.n; i++)
        bb_le(&kv, f32_bits(v.scores[i]), 4);
    kv_arr_head(&kv, "tokenizer.ggml.token_type", M40_GGUF_INT32, (uint64_t)v.n);
    for (int32_t i = 0; i < v.n; i++)
        bb_le(&kv, (uint32_t)v.types[i], 4);
    kv_u32(&kv, "tokenizer.ggml.unknown_token_id", 0);
    kv_u32(&kv, "tokenizer.ggml.bos_token_id", 1);
    kv_u32(&kv, "tokenizer.ggml.eos_token_id", 2);
    kv_bool(&kv, "tokenizer.ggml.add_bos_token", 1);
    kv_bool(&kv, "tokenizer.ggml.add_eos_token", 0);
    vocab_free(&v);

    bb_put(b, "GGUF", 4);
    bb_le(b, 3, 4);
    bb_le(b, p->n, 8);
    bb_le(b, kv.n_kv, 8);
    bb_put(b, kv.p, kv.len);
    int kv_oom = kv.oom;
    free(kv.p);
    uint64_t off = 0;
    for (size_t i = 0; i < p->n; i++) {
        plan_tensor *t = &p->t[i];
        t->offset = off;
        bb_str(b, t->name, strlen(t->name));
        bb_le(b, t->n_dims, 4);
        bb_le(b, t->ne0, 8);
        if (t->n_dims > 1)
            bb_le(b, t->ne1 / t->ne2, 8);
        if (t->n_dims > 2)
            bb_le(b, t->ne2, 8);
        bb_le(b, t->type, 4);
        bb_le(b, t->offset, 8);
        off += (t->nbytes + MK_ALIGNMENT - 1) / MK_ALIGNMENT * MK_ALIGNMENT;
    }
    static const unsigned char zeros[MK_ALIGNMENT];
    bb_put(b, zeros, (MK_ALIGNMENT - b->len % MK_ALIGNMENT) % MK_ALIGNMENT);
    if (b->oom || kv_oom) {
        snprintf(err, errlen, "out of memory building the GGUF header");
        return -1;
    }
    *data_bytes = off;
    return 0;
}

/* ---------- parallel generation ---------- */

typedef struct {
    uint32_t tensor;
    uint64_t row0, n_rows;
} chunk;

typedef struct {
    const plan *p;
    const chunk *chunks;
    uint64_t seed;
    int quick; /* m40_quantize_row_quick */
    int fd;
    uint64_t data_start;
    float **fbuf;
    unsigned char **obuf;
    atomic_int err_no;   /* first write error (errno), 0 while all is well */
    atomic_int failed;
} gen_job;

static void gen_chunk(void *ctx, int task, int thread)
{
    gen_job *j = ctx;
    if (atomic_load_explicit(&j->failed, memory_order_relaxed))
        return;
    const chunk *c = &j->chunks[task];
    const plan_tensor *t = &j->p->t[c->tensor];
    float *x = j->fbuf[thread];
    unsigned char *y = j->obuf[thread];
    for (uint64_t r = 0; r < c->n_rows; r++) {
        float *row = x + r * t->ne0;
        if (t->std == 0.0f) {
            for (uint64_t i = 0; i < t->ne0; i++)
                row[i] = 1.0f;
        } else {
            xoshiro256 rng;
            row_rng(&rng, j->seed, t->name_hash, c->row0 + r);
            fill_normal(&rng, row, (int64_t)t->ne0, t->std);
        }
        (j->quick ? m40_quantize_row_quick : m40_quantize_row)(t->type, row, y + r * t->row_bytes, (int64_t)t->ne0);
    }
    size_t len = (size_t)(c->n_rows * t->row_bytes), done = 0;
    off_t pos = (off_t)(j->data_start + t->offset + c->row0 * t->row_bytes);
    while (done < len) {
        ssize_t w = pwrite(j->fd, y + done, len - done, pos + (off_t)done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            int expected = 0;
            atomic_compare_exchange_strong(&j->err_no, &expected, w < 0 ? errno : EIO);
            atomic_store(&j->failed, 1);
            return;
        }
        done += (size_t)w;
    }
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int write_all_fd(int fd, const void *data, size_t n, off_t pos)
{
    const unsigned char *p = data;
    while (n) {
        ssize_t w = pwrite(fd, p, n, pos);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
        pos += w;
    }
    return 0;
}

int m40_mkmodel_write(const m40_mkmodel_opts *o, const char *path, m40_mkmodel_stats *stats, char *err,
                      size_t errlen)
{
    double t0 = now_s();
    const m40_mkmodel_shape *s = o->shape;
    int32_t L = o->n_layers > 0 ? o->n_layers : s->n_layers;
    if (L > 4096) {
        snprintf(err, errlen, "%d layers: at most 4096", (int)L);
        return -1;
    }
    if ((!s->head_dim && s->dim % s->n_heads) || s->n_heads % s->n_kv_heads) {
        snprintf(err, errlen, "shape %s: inconsistent head counts", s->name);
        return -1;
    }
    if (o->ftype == M40_MK_MXFP4 && !s->n_experts) {
        snprintf(err, errlen, "type MXFP4 quantizes the experts: shape %s has none", s->name);
        return -1;
    }
    int rc = -1, fd = -1;
    plan p = {0};
    bytebuf hdr = {0};
    chunk *chunks = NULL;
    m40_threadpool *pool = NULL;
    gen_job job = {0};
    char *part = NULL;
    uint64_t data_bytes;
    if (plan_build(&p, o, L, err, errlen) || build_header(&hdr, o, L, &p, &data_bytes, err, errlen))
        goto out;
    uint64_t total = hdr.len + data_bytes, n_params = 0;
    for (size_t i = 0; i < p.n; i++)
        n_params += p.t[i].ne0 * p.t[i].ne1;
    if (stats) {
        memset(stats, 0, sizeof *stats);
        stats->file_bytes = total;
        stats->n_tensors = p.n;
        stats->n_params = n_params;
        stats->weight_bytes = data_bytes;
    }
    if (o->dry_run) {
        rc = 0;
        goto out;
    }

    /* chunks: whole rows, about MK_CHUNK_ELEMS elements each */
    size_t n_chunks = 0, cap_chunks = 0;
    for (size_t i = 0; i < p.n; i++) {
        uint64_t per = p.t[i].ne0 >= MK_CHUNK_ELEMS ? 1 : MK_CHUNK_ELEMS / p.t[i].ne0;
        for (uint64_t r = 0; r < p.t[i].ne1; r += per) {
            if (n_chunks == cap_chunks) {
                cap_chunks = cap_chunks ? cap_chunks * 2 : 1024;
                chunk *nc = realloc(chunks, cap_chunks * sizeof *nc);
                if (!nc) {
                    snprintf(err, errlen, "out of memory");
                    goto out;
                }
                chunks = nc;
            }
            chunks[n_chunks++] = (chunk){(uint32_t)i, r, p.t[i].ne1 - r < per ? p.t[i].ne1 - r : per};
        }
    }
    if (n_chunks > (size_t)2147483647) {
        snprintf(err, errlen, "model too large (%zu chunks)", n_chunks);
        goto out;
    }
    uint64_t max_elems = 0, max_bytes = 0;
    for (size_t i = 0; i < n_chunks; i++) {
        const plan_tensor *t = &p.t[chunks[i].tensor];
        if (chunks[i].n_rows * t->ne0 > max_elems)
            max_elems = chunks[i].n_rows * t->ne0;
        if (chunks[i].n_rows * t->row_bytes > max_bytes)
            max_bytes = chunks[i].n_rows * t->row_bytes;
    }

    pool = m40_threadpool_new(o->n_threads);
    if (!pool) {
        snprintf(err, errlen, "cannot start the thread pool");
        goto out;
    }
    int nt = m40_threadpool_size(pool);
    job.fbuf = calloc((size_t)nt, sizeof *job.fbuf);
    job.obuf = calloc((size_t)nt, sizeof *job.obuf);
    if (!job.fbuf || !job.obuf) {
        snprintf(err, errlen, "out of memory");
        goto out;
    }
    for (int i = 0; i < nt; i++) {
        job.fbuf[i] = malloc((size_t)max_elems * sizeof(float));
        job.obuf[i] = malloc((size_t)max_bytes);
        if (!job.fbuf[i] || !job.obuf[i]) {
            snprintf(err, errlen, "out of memory");
            goto out;
        }
    }

    size_t plen = strlen(path);
    part = malloc(plen + 6);
    if (!part) {
        snprintf(err, errlen, "out of memory");
        goto out;
    }
    memcpy(part, path, plen);
    memcpy(part + plen, ".part", 6);
    fd = open(part, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        snprintf(err, errlen, "cannot create %s: %s", part, strerror(errno));
        goto out;
    }
    /* Reserve the space up front (an early, clean ENOSPC); where the filesystem cannot,
     * ftruncate still gives the padding its zeros. */
    if (fallocate(fd, 0, 0, (off_t)total) != 0 && errno == ENOSPC) {
        snprintf(err, errlen, "cannot write %s: %s (%llu bytes needed)", part, strerror(ENOSPC),
                 (unsigned long long)total);
        goto fail_file;
    }
    if (ftruncate(fd, (off_t)total) != 0) {
        snprintf(err, errlen, "cannot size %s: %s", part, strerror(errno));
        goto fail_file;
    }
    if (write_all_fd(fd, hdr.p, hdr.len, 0) != 0) {
        snprintf(err, errlen, "cannot write %s: %s", part, strerror(errno));
        goto fail_file;
    }

    job.p = &p;
    job.chunks = chunks;
    job.seed = o->seed;
    job.quick = o->quick;
    job.fd = fd;
    job.data_start = hdr.len;
    m40_threadpool_run(pool, (int)n_chunks, gen_chunk, &job);
    if (atomic_load(&job.failed)) {
        snprintf(err, errlen, "cannot write %s: %s", part, strerror(atomic_load(&job.err_no)));
        goto fail_file;
    }
    if (close(fd) != 0) {
        fd = -1;
        snprintf(err, errlen, "cannot write %s: %s", part, strerror(errno));
        goto fail_file;
    }
    fd = -1;
    if (rename(part, path) != 0) {
        snprintf(err, errlen, "cannot rename %s to %s: %s", part, path, strerror(errno));
        goto fail_file;
    }
    if (stats)
        stats->n_threads = nt;
    rc = 0;
    goto out;

fail_file:
    if (fd >= 0)
        close(fd);
    fd = -1;
    unlink(part);
out:
    if (stats && rc == 0)
        stats->seconds = now_s() - t0;
    if (job.fbuf || job.obuf) {
        int nt2 = pool ? m40_threadpool_size(pool) : 0;
        for (int i = 0; i < nt2; i++) {
            free(job.fbuf ? job.fbuf[i] : NULL);
            free(job.obuf ? job.obuf[i] : NULL);
        }
    }
    free(job.fbuf);
    free(job.obuf);
    m40_threadpool_free(pool);
    free(part);
    free(chunks);
    free(hdr.p);
    free(p.t);
    return rc;
}
