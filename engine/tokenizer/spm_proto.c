/* Serialized sentencepiece ModelProto built from a GGUF "llama" vocabulary, written in
 * protobuf wire format by hand so that the project needs no protobuf library.
 *
 * Field numbers are those of sentencepiece_model.proto:
 *   ModelProto      1 pieces (repeated SentencePiece), 2 trainer_spec, 3 normalizer_spec
 *   SentencePiece   1 piece, 2 score (float), 3 type (NORMAL 1, UNKNOWN 2, CONTROL 3,
 *                   USER_DEFINED 4, UNUSED 5, BYTE 6 -- the same numbers as GGUF token types)
 *   TrainerSpec     3 model_type (BPE 2), 4 vocab_size, 26 allow_whitespace_only_pieces,
 *                   35 byte_fallback, 40..43 unk/bos/eos/pad ids, 45..48 their pieces
 *   NormalizerSpec  1 name, 2 precompiled_charsmap, 3 add_dummy_prefix,
 *                   4 remove_extra_whitespaces, 5 escape_whitespaces
 *
 * Settings follow what Llama 2's own tokenizer.model holds (dumped from
 * ../shared/tokenizer/llama2-tokenizer.model): model_type BPE -- the GGUF scores of
 * these vocabularies are merge priorities (negated merge ranks), not unigram
 * log-probabilities --, byte_fallback, normalizer "identity" with no charsmap,
 * add_dummy_prefix true, remove_extra_whitespaces false, escape_whitespaces true.
 * add_dummy_prefix follows tokenizer.ggml.add_space_prefix when the GGUF has it.
 *
 * SentencePiece refuses models that real GGUF files can contain (it requires exactly
 * one UNKNOWN piece, no empty or duplicate pieces, BYTE pieces spelled <0xNN>), so the
 * types are adjusted here -- only in the proto: the tokenizer keeps the GGUF's own
 * types for rendering. See spm_fix_types(). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "spm.h"
#include "util/hash.h"

enum {
    SPM_NORMAL = 1,
    SPM_UNKNOWN = 2,
    SPM_CONTROL = 3,
    SPM_USER_DEFINED = 4,
    SPM_UNUSED = 5,
    SPM_BYTE = 6,
};

/* Growable output buffer; a failed allocation latches oom so that callers check once. */
typedef struct {
    unsigned char *p;
    size_t len, cap;
    int oom;
} pbuf;

static int pb_reserve(pbuf *b, size_t more)
{
    if (b->oom)
        return -1;
    if (more > SIZE_MAX - b->len) {
        b->oom = 1;
        return -1;
    }
    if (b->len + more <= b->cap)
        return 0;
    size_t ncap = b->cap ? b->cap : 256;
    while (ncap < b->len + more) {
        if (ncap > SIZE_MAX / 2) {
            b->oom = 1;
            return -1;
        }
        ncap *= 2;
    }
    unsigned char *np = realloc(b->p, ncap);
    if (!np) {
        b->oom = 1;
        return -1;
    }
    b->p = np;
    b->cap = ncap;
    return 0;
}

static void pb_bytes(pbuf *b, const void *data, size_t n)
{
    if (pb_reserve(b, n) == 0 && n) {
        memcpy(b->p + b->len, data, n);
        b->len += n;
    }
}

static void pb_varint(pbuf *b, uint64_t v)
{
    unsigned char tmp[10];
    size_t n = 0;
    do {
        unsigned char c = v & 0x7f;
        v >>= 7;
        tmp[n++] = c | (v ? 0x80 : 0);
    } while (v);
    pb_bytes(b, tmp, n);
}

static void pb_key(pbuf *b, unsigned field, unsigned wire)
{
    pb_varint(b, ((uint64_t)field << 3) | wire);
}

/* int32 fields: negative values are sign-extended to 64 bits (10-byte varint). */
static void pb_int32(pbuf *b, unsigned field, int32_t v)
{
    pb_key(b, field, 0);
    pb_varint(b, (uint64_t)(int64_t)v);
}

static void pb_bool(pbuf *b, unsigned field, int v)
{
    pb_key(b, field, 0);
    pb_varint(b, v ? 1 : 0);
}

static void pb_float(pbuf *b, unsigned field, float f)
{
    unsigned char le[4];
    uint32_t u;
    memcpy(&u, &f, 4);
    for (int i = 0; i < 4; i++)
        le[i] = (unsigned char)(u >> (8 * i));
    pb_key(b, field, 5);
    pb_bytes(b, le, 4);
}

static void pb_lenfield(pbuf *b, unsigned field, const void *data, size_t n)
{
    pb_key(b, field, 2);
    pb_varint(b, n);
    pb_bytes(b, data, n);
}

/* 1 when s is exactly "<0xNN>" with upper-case hex, the only spelling SentencePiece
 * accepts for BYTE pieces (and the one llama.cpp looks up for byte fallback). */
static int spm_is_byte_piece(const char *s, uint64_t len)
{
    static const char hex[] = "0123456789ABCDEF";
    return len == 6 && s[0] == '<' && s[1] == '0' && s[2] == 'x' && strchr(hex, s[3]) && s[3] &&
           strchr(hex, s[4]) && s[4] && s[5] == '>';
}

/* FNV-1a over the piece bytes, for the duplicate check. */
static uint64_t spm_hash(const char *s, uint64_t len) { return m40_fnv1a64(s, (size_t)len); }

static int64_t spm_id_key(const m40_gguf *g, const char *key, uint64_t n)
{
    int64_t v;
    if (m40_gguf_get_i64(g, key, &v) != 0 || v < 0 || (uint64_t)v >= n)
        return -1;
    return v;
}

/* Adjusts the GGUF types into ones SentencePiece accepts, marking pieces that must be
 * renamed (empty, or a repeat of an earlier piece) in rename[]:
 *  - exactly one UNKNOWN: tokenizer.ggml.unknown_token_id, else the first UNKNOWN-typed
 *    token, else a piece spelled "<unk>". Other UNKNOWN-typed tokens (Phi-3 pads its
 *    vocabulary with them) become CONTROL: never produced from text, as in llama.cpp.
 *  - BYTE pieces not spelled <0xNN> become CONTROL (byte fallback could not use them).
 *  - types outside 1..6 (0 is "undefined" in GGUF) are treated as NORMAL.
 *  - an empty or repeated piece becomes CONTROL under a unique name that no text can
 *    produce; its id keeps its place so that every other id is unchanged.
 * Returns the unk id, or -1 with err. */
static int64_t spm_fix_types(const m40_gguf_value *toks, int32_t *types, unsigned char *rename, int64_t unk_key,
                             char *err, size_t errlen)
{
    uint64_t n = toks->v.arr.n;
    int64_t unk = unk_key;
    for (uint64_t i = 0; i < n; i++) {
        const m40_gguf_value *t = &toks->v.arr.items[i];
        if (types[i] < SPM_NORMAL || types[i] > SPM_BYTE)
            types[i] = SPM_NORMAL;
        if (types[i] == SPM_BYTE && !spm_is_byte_piece(t->v.str.ptr, t->v.str.len))
            types[i] = SPM_CONTROL;
        if (unk < 0 && types[i] == SPM_UNKNOWN)
            unk = (int64_t)i;
    }
    for (uint64_t i = 0; unk < 0 && i < n; i++) {
        const m40_gguf_value *t = &toks->v.arr.items[i];
        if (t->v.str.len == 5 && !memcmp(t->v.str.ptr, "<unk>", 5))
            unk = (int64_t)i;
    }
    if (unk < 0) {
        snprintf(err, errlen, "vocabulary has no unknown token (no tokenizer.ggml.unknown_token_id, "
                              "no UNKNOWN-typed token, no \"<unk>\"); SentencePiece needs one");
        return -1;
    }
    for (uint64_t i = 0; i < n; i++)
        if (types[i] == SPM_UNKNOWN && (int64_t)i != unk)
            types[i] = SPM_CONTROL;
    types[unk] = SPM_UNKNOWN;

    /* Duplicate check: open addressing over ids, table twice the next power of two. */
    uint64_t cap = 16;
    while (cap < 2 * n)
        cap *= 2;
    int64_t *slot = malloc(cap * sizeof *slot);
    if (!slot) {
        snprintf(err, errlen, "out of memory building the SentencePiece model (%llu pieces)",
                 (unsigned long long)n);
        return -1;
    }
    for (uint64_t i = 0; i < cap; i++)
        slot[i] = -1;
    for (uint64_t i = 0; i < n; i++) {
        const m40_gguf_value *t = &toks->v.arr.items[i];
        if (t->v.str.len == 0) {
            rename[i] = 1;
            continue;
        }
        uint64_t h = spm_hash(t->v.str.ptr, t->v.str.len) & (cap - 1);
        for (;;) {
            if (slot[h] < 0) {
                slot[h] = (int64_t)i;
                break;
            }
            const m40_gguf_value *o = &toks->v.arr.items[slot[h]];
            if (o->v.str.len == t->v.str.len && !memcmp(o->v.str.ptr, t->v.str.ptr, t->v.str.len)) {
                rename[i] = 1;
                break;
            }
            h = (h + 1) & (cap - 1);
        }
    }
    free(slot);
    for (uint64_t i = 0; i < n; i++)
        if (rename[i]) {
            if ((int64_t)i == unk) {
                snprintf(err, errlen, "unknown token %lld has an empty or repeated piece", (long long)unk);
                return -1;
            }
            types[i] = SPM_CONTROL;
        }
    return unk;
}

int m40_spm_proto_from_gguf(const m40_gguf *g, unsigned char **out, size_t *out_len, char *err, size_t errlen)
{
    *out = NULL;
    *out_len = 0;
    const m40_gguf_value *toks = m40_gguf_get_arr(g, "tokenizer.ggml.tokens", M40_GGUF_STRING);
    if (!toks) {
        snprintf(err, errlen, "tokenizer.ggml.tokens missing or not an array of strings");
        return -1;
    }
    uint64_t n = toks->v.arr.n;
    if (n == 0 || n > INT32_MAX) {
        snprintf(err, errlen, "tokenizer.ggml.tokens has %llu entries", (unsigned long long)n);
        return -1;
    }
    const m40_gguf_value *scores = m40_gguf_get_arr(g, "tokenizer.ggml.scores", M40_GGUF_FLOAT32);
    if (!scores && m40_gguf_get(g, "tokenizer.ggml.scores")) {
        snprintf(err, errlen, "tokenizer.ggml.scores is not an array of float32");
        return -1;
    }
    if (scores && scores->v.arr.n != n) {
        snprintf(err, errlen, "tokenizer.ggml.scores has %llu entries for %llu tokens",
                 (unsigned long long)scores->v.arr.n, (unsigned long long)n);
        return -1;
    }
    const m40_gguf_value *ttype = m40_gguf_get_arr(g, "tokenizer.ggml.token_type", M40_GGUF_INT32);
    if (!ttype)
        ttype = m40_gguf_get_arr(g, "tokenizer.ggml.token_type", M40_GGUF_UINT32);
    if (!ttype && m40_gguf_get(g, "tokenizer.ggml.token_type")) {
        snprintf(err, errlen, "tokenizer.ggml.token_type is not an array of int32");
        return -1;
    }
    if (ttype && ttype->v.arr.n != n) {
        snprintf(err, errlen, "tokenizer.ggml.token_type has %llu entries for %llu tokens",
                 (unsigned long long)ttype->v.arr.n, (unsigned long long)n);
        return -1;
    }

    int32_t *types = malloc(n * sizeof *types);
    unsigned char *rename = calloc(n, 1);
    pbuf b = {0}, sub = {0};
    if (!types || !rename) {
        snprintf(err, errlen, "out of memory building the SentencePiece model (%llu pieces)", (unsigned long long)n);
        goto fail;
    }
    for (uint64_t i = 0; i < n; i++) {
        int64_t t = SPM_NORMAL;
        if (ttype)
            t = ttype->v.arr.items[i].type == M40_GGUF_INT32 ? ttype->v.arr.items[i].v.i64
                                                              : (int64_t)ttype->v.arr.items[i].v.u64;
        types[i] = (t >= 0 && t <= 6) ? (int32_t)t : 0;
    }
    int64_t unk = spm_fix_types(toks, types, rename, spm_id_key(g, "tokenizer.ggml.unknown_token_id", n), err,
                                errlen);
    if (unk < 0)
        goto fail;
    int64_t bos = spm_id_key(g, "tokenizer.ggml.bos_token_id", n);
    int64_t eos = spm_id_key(g, "tokenizer.ggml.eos_token_id", n);
    int64_t pad = spm_id_key(g, "tokenizer.ggml.padding_token_id", n);
    int add_prefix = 1;
    if (m40_gguf_get(g, "tokenizer.ggml.add_space_prefix") &&
        m40_gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &add_prefix) != 0) {
        snprintf(err, errlen, "tokenizer.ggml.add_space_prefix is not a bool");
        goto fail;
    }

    int have_bytes = 0;
    for (uint64_t i = 0; i < n; i++) {
        const m40_gguf_value *t = &toks->v.arr.items[i];
        char alias[32];
        const char *p = t->v.str.ptr;
        size_t plen = (size_t)t->v.str.len;
        if (rename[i]) {
            /* 0xFF never occurs in UTF-8 text, so nothing can encode to this name. */
            plen = (size_t)snprintf(alias, sizeof alias, "\xff" "m40-dup-%llu", (unsigned long long)i);
            p = alias;
        }
        float sc = scores ? (float)scores->v.arr.items[i].v.f64 : 0.0f;
        /* NaN breaks the merge queue's ordering; such a piece merges last. */
        if (isnan(sc))
            sc = -1e30f;
        if (types[i] == SPM_BYTE)
            have_bytes = 1;
        sub.len = 0;
        pb_lenfield(&sub, 1, p, plen);
        pb_float(&sub, 2, sc);
        if (types[i] != SPM_NORMAL) /* NORMAL is the proto default */
            pb_int32(&sub, 3, types[i]);
        if (sub.oom)
            break;
        pb_lenfield(&b, 1, sub.p, sub.len);
    }

    /* trainer_spec */
    sub.len = 0;
    pb_int32(&sub, 3, 2); /* model_type BPE */
    pb_int32(&sub, 4, (int32_t)n);
    pb_bool(&sub, 26, 1); /* allow_whitespace_only_pieces, as Llama 2's model */
    pb_bool(&sub, 35, have_bytes);
    pb_int32(&sub, 40, (int32_t)unk);
    pb_int32(&sub, 41, (int32_t)bos);
    pb_int32(&sub, 42, (int32_t)eos);
    pb_int32(&sub, 43, (int32_t)pad);
    const int64_t sp_ids[4] = {unk, bos, eos, pad};
    for (int k = 0; k < 4; k++)
        if (sp_ids[k] >= 0 && !rename[sp_ids[k]]) {
            const m40_gguf_value *t = &toks->v.arr.items[sp_ids[k]];
            pb_lenfield(&sub, 45 + (unsigned)k, t->v.str.ptr, (size_t)t->v.str.len);
        }
    pb_lenfield(&b, 2, sub.p, sub.len);

    /* normalizer_spec */
    sub.len = 0;
    pb_lenfield(&sub, 1, "identity", 8);
    pb_lenfield(&sub, 2, "", 0);
    pb_bool(&sub, 3, add_prefix);
    pb_bool(&sub, 4, 0);
    pb_bool(&sub, 5, 1);
    pb_lenfield(&b, 3, sub.p, sub.len);

    if (b.oom || sub.oom) {
        snprintf(err, errlen, "out of memory serializing the SentencePiece model (%llu pieces)",
                 (unsigned long long)n);
        goto fail;
    }
    free(sub.p);
    free(types);
    free(rename);
    *out = b.p;
    *out_len = b.len;
    return 0;

fail:
    free(b.p);
    free(sub.p);
    free(types);
    free(rename);
    return -1;
}
