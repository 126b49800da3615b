/* Tokenizer front end (tokenizer.h): picks the backend from tokenizer.ggml.model, keeps
 * its own copy of the vocabulary (pieces, types, special ids) so that the GGUF may be
 * closed, splits control tokens out of trusted text, and turns ids back into bytes.
 *
 * Special tokens and the SPM dummy prefix: with parse_special, the text is cut at
 * control/user-defined token strings (longest match first) and every text fragment
 * between them is encoded on its own. For SentencePiece this means every fragment gets
 * the dummy-prefix space (the fragment at the start, and each one following a special
 * token) -- what llama.cpp does (its "is_prev_special" rule) and what encoding each
 * segment of a Llama 2 chat prompt separately with SentencePiece gives.
 *
 * USER_DEFINED pieces are plain text that the reference tokenizers always match before
 * anything else (NeoX/MPT whitespace runs, DeepSeek's added letters, Phi-3's "</s>"),
 * with or without parse_special: SentencePiece does that itself, for BPE the split
 * happens here. Control tokens are never produced from text unless parse_special. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bpe.h"
#include "spm.h"
#include "tokenizer.h"

#define M40_SPM_SPACE "\xe2\x96\x81" /* U+2581, SentencePiece's whitespace symbol */
#define M40_SPM_UNK_SURFACE " \xe2\x81\x87 " /* " ⁇ ", how SentencePiece renders <unk> */

struct m40_tokenizer {
    int kind;
    m40_spm *spm;
    m40_bpe *bpe;
    int32_t n_vocab;
    char *arena;        /* every piece, NUL-terminated, back to back */
    size_t *piece_off;  /* offset of piece i in arena */
    uint32_t *piece_len;
    uint8_t *types;     /* GGUF token types as stored (0 when out of range) */
    int32_t bos, eos, eot, unk;
    int add_bos;
    int dummy_prefix;   /* SPM: text starts with the ▁ prefix, stripped when decoding */
    int32_t *eog;
    int n_eog;
    int32_t rendered[8]; /* control tokens that decode to their text (harmony's markers) */
    int n_rendered;
    /* find_piece: open addressing table of ids, hcap a power of two */
    int32_t *hash;
    uint64_t hcap;
    /* parse_special: control/user-defined ids grouped by first byte, longest first */
    int32_t *special;
    int32_t n_special;
    int32_t special_start[257];
    size_t max_piece_len; /* the longest piece in bytes (at least 1) */
};

static uint64_t tok_hash(const char *s, size_t len)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < len; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h;
}

static const char *tok_piece(const m40_tokenizer *t, int32_t id, uint32_t *len)
{
    *len = t->piece_len[id];
    return t->arena + t->piece_off[id];
}

void m40_tokenizer_free(m40_tokenizer *t)
{
    if (!t)
        return;
    m40_spm_free(t->spm);
    if (t->bpe)
        m40_bpe_free(t->bpe);
    free(t->arena);
    free(t->piece_off);
    free(t->piece_len);
    free(t->types);
    free(t->eog);
    free(t->hash);
    free(t->special);
    free(t);
}

/* Allocates the per-token arrays and copies pieces in; the caller fills types. */
static int tok_alloc_vocab(m40_tokenizer *t, uint64_t n, size_t total_bytes, char *err, size_t errlen)
{
    if (n == 0 || n > INT32_MAX) {
        snprintf(err, errlen, "vocabulary has %llu tokens", (unsigned long long)n);
        return -1;
    }
    t->n_vocab = (int32_t)n;
    t->arena = malloc(total_bytes + n);
    t->piece_off = malloc(n * sizeof *t->piece_off);
    t->piece_len = malloc(n * sizeof *t->piece_len);
    t->types = calloc(n, 1);
    if (!t->arena || !t->piece_off || !t->piece_len || !t->types) {
        snprintf(err, errlen, "out of memory for a vocabulary of %llu tokens", (unsigned long long)n);
        return -1;
    }
    return 0;
}

static void tok_set_piece(m40_tokenizer *t, int32_t id, size_t *pos, const char *s, size_t len)
{
    t->piece_off[id] = *pos;
    t->piece_len[id] = (uint32_t)len;
    memcpy(t->arena + *pos, s, len);
    t->arena[*pos + len] = 0;
    *pos += len + 1;
}

static int tok_build_hash(m40_tokenizer *t, char *err, size_t errlen)
{
    uint64_t cap = 16;
    while (cap < 2 * (uint64_t)t->n_vocab)
        cap *= 2;
    t->hash = malloc(cap * sizeof *t->hash);
    if (!t->hash) {
        snprintf(err, errlen, "out of memory for the piece index");
        return -1;
    }
    t->hcap = cap;
    for (uint64_t i = 0; i < cap; i++)
        t->hash[i] = -1;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        uint32_t len;
        const char *p = tok_piece(t, id, &len);
        uint64_t h = tok_hash(p, len) & (cap - 1);
        for (;;) {
            int32_t o = t->hash[h];
            if (o < 0) {
                t->hash[h] = id;
                break;
            }
            if (t->piece_len[o] == len && !memcmp(t->arena + t->piece_off[o], p, len))
                break; /* the first id of a repeated piece wins */
            h = (h + 1) & (cap - 1);
        }
    }
    return 0;
}

int32_t m40_tokenizer_find_piece(const m40_tokenizer *t, const char *piece)
{
    if (!t || !piece || !t->hash)
        return -1;
    size_t len = strlen(piece);
    uint64_t h = tok_hash(piece, len) & (t->hcap - 1);
    for (;;) {
        int32_t o = t->hash[h];
        if (o < 0)
            return -1;
        if (t->piece_len[o] == len && !memcmp(t->arena + t->piece_off[o], piece, len))
            return o;
        h = (h + 1) & (t->hcap - 1);
    }
}

static int special_cmp_ctx_first(const m40_tokenizer *t, int32_t a, int32_t b)
{
    unsigned char fa = (unsigned char)t->arena[t->piece_off[a]], fb = (unsigned char)t->arena[t->piece_off[b]];
    if (fa != fb)
        return fa < fb ? -1 : 1;
    if (t->piece_len[a] != t->piece_len[b])
        return t->piece_len[a] > t->piece_len[b] ? -1 : 1; /* longest first */
    return a < b ? -1 : a > b;
}

/* Insertion sort would be quadratic on vocabularies with thousands of control tokens;
 * a small merge sort keeps it n log n without a global context for qsort. */
static void special_sort(const m40_tokenizer *t, int32_t *v, int32_t *tmp, int32_t n)
{
    if (n < 2)
        return;
    int32_t h = n / 2;
    special_sort(t, v, tmp, h);
    special_sort(t, v + h, tmp, n - h);
    int32_t i = 0, j = h, k = 0;
    while (i < h && j < n)
        tmp[k++] = special_cmp_ctx_first(t, v[i], v[j]) <= 0 ? v[i++] : v[j++];
    while (i < h)
        tmp[k++] = v[i++];
    while (j < n)
        tmp[k++] = v[j++];
    memcpy(v, tmp, (size_t)n * sizeof *v);
}

static int tok_is_special_type(int type)
{
    return type == M40_TOKEN_CONTROL || type == M40_TOKEN_USER_DEFINED;
}

static int tok_add_eog(m40_tokenizer *t, int32_t id)
{
    if (id < 0 || id >= t->n_vocab)
        return 0;
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id)
            return 0;
    int32_t *n = realloc(t->eog, (size_t)(t->n_eog + 1) * sizeof *n);
    if (!n)
        return -1;
    t->eog = n;
    t->eog[t->n_eog++] = id;
    return 0;
}

static int32_t tok_control(const m40_tokenizer *t, const char *piece)
{
    int32_t id = m40_tokenizer_find_piece(t, piece);
    return id >= 0 && t->types[id] == M40_TOKEN_CONTROL ? id : -1;
}

/* o200k_harmony (gpt-oss): an assistant turn is several messages (analysis, then the
 * answer or a call), each closed by <|end|>, and the turn ends at <|return|> (answer
 * given) or <|call|> (a tool is to run). So where both are control tokens, <|end|> is no
 * end of generation and those two are, as llama.cpp has it; and the markers of a
 * message's header and end decode to their text, so that the output parser
 * (m40_chat_parse.h, harmony) sees the channels, and grammars can force them. They stay
 * control tokens for encoding: typed in a message they are text, never structure. */
static int tok_harmony(m40_tokenizer *t)
{
    int32_t ret = tok_control(t, "<|return|>"), call = tok_control(t, "<|call|>"), end = tok_control(t, "<|end|>");
    if (ret < 0 || call < 0 || end < 0 || tok_control(t, "<|channel|>") < 0)
        return 0;
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == end) {
            t->eog[i] = t->eog[--t->n_eog];
            break;
        }
    if (tok_add_eog(t, ret) || tok_add_eog(t, call))
        return -1;
    static const char *const shown[] = {"<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>"};
    for (size_t i = 0; i < sizeof shown / sizeof *shown; i++) {
        int32_t id = tok_control(t, shown[i]);
        if (id >= 0)
            t->rendered[t->n_rendered++] = id;
    }
    return 0;
}

/* Everything derived from pieces and types: piece index, special-token table, EOG ids,
 * the longest piece. */
static int tok_finish(m40_tokenizer *t, char *err, size_t errlen)
{
    if (tok_build_hash(t, err, errlen) != 0)
        return -1;

    t->max_piece_len = 1;
    for (int32_t id = 0; id < t->n_vocab; id++)
        if (t->piece_len[id] > t->max_piece_len)
            t->max_piece_len = t->piece_len[id];

    int32_t n = 0;
    for (int32_t id = 0; id < t->n_vocab; id++)
        if (tok_is_special_type(t->types[id]) && t->piece_len[id] > 0)
            n++;
    t->special = malloc(((size_t)n + 1) * sizeof *t->special);
    int32_t *tmp = malloc(((size_t)n + 1) * sizeof *tmp);
    if (!t->special || !tmp) {
        free(tmp);
        snprintf(err, errlen, "out of memory for the special-token table");
        return -1;
    }
    n = 0;
    for (int32_t id = 0; id < t->n_vocab; id++)
        if (tok_is_special_type(t->types[id]) && t->piece_len[id] > 0)
            t->special[n++] = id;
    special_sort(t, t->special, tmp, n);
    free(tmp);
    t->n_special = n;
    /* special_start[c]..special_start[c+1]: the candidates starting with byte c */
    int32_t k = 0;
    for (int c = 0; c < 256; c++) {
        t->special_start[c] = k;
        while (k < n && (unsigned char)t->arena[t->piece_off[t->special[k]]] == c)
            k++;
    }
    t->special_start[256] = n;

    /* End of generation: eos, eot, and the turn-end pieces of common chat formats when
     * the vocabulary marks them as control tokens. */
    static const char *const eog_pieces[] = {"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>",
                                             "<|end|>", "<end_of_turn>", "<|end_of_text|>", "<EOT>"};
    if (tok_add_eog(t, t->eos) || tok_add_eog(t, t->eot))
        goto oom;
    for (size_t i = 0; i < sizeof eog_pieces / sizeof eog_pieces[0]; i++) {
        int32_t id = m40_tokenizer_find_piece(t, eog_pieces[i]);
        if (id >= 0 && t->types[id] == M40_TOKEN_CONTROL && tok_add_eog(t, id))
            goto oom;
    }
    if (tok_harmony(t) != 0)
        goto oom;
    return 0;
oom:
    snprintf(err, errlen, "out of memory for the end-of-generation ids");
    return -1;
}

/* An id key of the GGUF: its value when present and in range, else def. A present key
 * with an out-of-range value (llama.cpp writes 0xFFFFFFFF for "none") means none. */
static int32_t tok_gguf_id(const m40_gguf *g, const char *key, int32_t n_vocab, int32_t def)
{
    int64_t v;
    if (!m40_gguf_get(g, key))
        return def;
    if (m40_gguf_get_i64(g, key, &v) != 0 || v < 0 || v >= n_vocab)
        return -1;
    return (int32_t)v;
}

int m40_tokenizer_from_gguf(const m40_gguf *g, m40_tokenizer **out, char *err, size_t errlen)
{
    *out = NULL;
    const char *model = m40_gguf_get_str(g, "tokenizer.ggml.model");
    if (!model) {
        snprintf(err, errlen, "tokenizer.ggml.model missing or not a string");
        return -1;
    }
    int kind;
    if (!strcmp(model, "llama"))
        kind = M40_TOK_SPM;
    else if (!strcmp(model, "gpt2"))
        kind = M40_TOK_BPE;
    else {
        snprintf(err, errlen, "unsupported tokenizer.ggml.model \"%.64s\" (supported: llama, gpt2)", model);
        return -1;
    }
    const m40_gguf_value *toks = m40_gguf_get_arr(g, "tokenizer.ggml.tokens", M40_GGUF_STRING);
    if (!toks) {
        snprintf(err, errlen, "tokenizer.ggml.tokens missing or not an array of strings");
        return -1;
    }
    const m40_gguf_value *ttype = m40_gguf_get_arr(g, "tokenizer.ggml.token_type", M40_GGUF_INT32);
    if (!ttype)
        ttype = m40_gguf_get_arr(g, "tokenizer.ggml.token_type", M40_GGUF_UINT32);
    if (ttype && ttype->v.arr.n != toks->v.arr.n) {
        snprintf(err, errlen, "tokenizer.ggml.token_type has %llu entries for %llu tokens",
                 (unsigned long long)ttype->v.arr.n, (unsigned long long)toks->v.arr.n);
        return -1;
    }

    m40_tokenizer *t = calloc(1, sizeof *t);
    if (!t) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    t->kind = kind;
    uint64_t n = toks->v.arr.n;
    size_t total = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t l = toks->v.arr.items[i].v.str.len;
        if (l > UINT32_MAX || l > SIZE_MAX - total - n) {
            snprintf(err, errlen, "tokenizer.ggml.tokens: token %llu too long", (unsigned long long)i);
            goto fail;
        }
        total += (size_t)l;
    }
    if (tok_alloc_vocab(t, n, total, err, errlen) != 0)
        goto fail;
    size_t pos = 0;
    for (uint64_t i = 0; i < n; i++) {
        const m40_gguf_value *s = &toks->v.arr.items[i];
        tok_set_piece(t, (int32_t)i, &pos, s->v.str.ptr, (size_t)s->v.str.len);
        int64_t ty = M40_TOKEN_NORMAL;
        if (ttype)
            ty = ttype->v.arr.items[i].type == M40_GGUF_INT32 ? ttype->v.arr.items[i].v.i64
                                                               : (int64_t)ttype->v.arr.items[i].v.u64;
        t->types[i] = (ty >= 1 && ty <= 6) ? (uint8_t)ty : 0;
    }

    int spm = kind == M40_TOK_SPM;
    /* llama.cpp's defaults for SentencePiece vocabularies: unk 0, bos 1, eos 2. */
    t->unk = tok_gguf_id(g, "tokenizer.ggml.unknown_token_id", t->n_vocab, spm && n > 0 ? 0 : -1);
    t->bos = tok_gguf_id(g, "tokenizer.ggml.bos_token_id", t->n_vocab, spm && n > 1 ? 1 : -1);
    t->eos = tok_gguf_id(g, "tokenizer.ggml.eos_token_id", t->n_vocab, spm && n > 2 ? 2 : -1);
    t->eot = tok_gguf_id(g, "tokenizer.ggml.eot_token_id", t->n_vocab, -1);
    t->add_bos = spm;
    if (m40_gguf_get(g, "tokenizer.ggml.add_bos_token") &&
        m40_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &t->add_bos) != 0) {
        snprintf(err, errlen, "tokenizer.ggml.add_bos_token is not a bool");
        goto fail;
    }

    if (spm) {
        t->dummy_prefix = 1;
        if (m40_gguf_get(g, "tokenizer.ggml.add_space_prefix") &&
            m40_gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &t->dummy_prefix) != 0) {
            snprintf(err, errlen, "tokenizer.ggml.add_space_prefix is not a bool");
            goto fail;
        }
        unsigned char *proto;
        size_t plen;
        if (m40_spm_proto_from_gguf(g, &proto, &plen, err, errlen) != 0)
            goto fail;
        t->spm = m40_spm_load_proto(proto, plen, err, errlen);
        free(proto);
        if (!t->spm)
            goto fail;
        if (m40_spm_n_pieces(t->spm) != t->n_vocab) {
            snprintf(err, errlen, "sentencepiece model has %d pieces for %d tokens", m40_spm_n_pieces(t->spm),
                     t->n_vocab);
            goto fail;
        }
    } else {
        t->bpe = m40_bpe_new(g, err, errlen);
        if (!t->bpe)
            goto fail;
    }
    if (tok_finish(t, err, errlen) != 0)
        goto fail;
    *out = t;
    return 0;
fail:
    m40_tokenizer_free(t);
    return -1;
}

/* ---- .model files: the few ModelProto fields the front end needs --------------------
 * SentencePiece loads the file itself; this reader only recovers what spm.h does not
 * expose: piece types, unk/bos/eos ids (TrainerSpec 40..42, defaults 0, 1, 2) and
 * add_dummy_prefix (NormalizerSpec 3, default true). Every length is bounds-checked. */

typedef struct {
    const unsigned char *p, *end;
} pb_reader;

static int pbr_varint(pb_reader *r, uint64_t *v)
{
    uint64_t x = 0;
    for (int s = 0; s < 64; s += 7) {
        if (r->p >= r->end)
            return -1;
        unsigned char c = *r->p++;
        x |= (uint64_t)(c & 0x7f) << s;
        if (!(c & 0x80)) {
            *v = x;
            return 0;
        }
    }
    return -1;
}

/* Next field: number, wire type, varint value or (for length-delimited) data/len. */
static int pbr_field(pb_reader *r, uint64_t *field, int *wire, uint64_t *val, const unsigned char **data,
                     uint64_t *len)
{
    uint64_t key;
    if (pbr_varint(r, &key) != 0)
        return -1;
    *field = key >> 3;
    *wire = (int)(key & 7);
    switch (*wire) {
    case 0:
        return pbr_varint(r, val);
    case 1:
    case 5: {
        size_t w = *wire == 1 ? 8 : 4;
        if ((size_t)(r->end - r->p) < w)
            return -1;
        *val = 0;
        for (size_t i = 0; i < w; i++)
            *val |= (uint64_t)r->p[i] << (8 * i);
        r->p += w;
        return 0;
    }
    case 2:
        if (pbr_varint(r, len) != 0 || *len > (uint64_t)(r->end - r->p))
            return -1;
        *data = r->p;
        r->p += *len;
        return 0;
    default: /* groups are not used by sentencepiece_model.proto */
        return -1;
    }
}

typedef struct {
    uint64_t n;
    size_t bytes;
    int32_t unk, bos, eos;
    int dummy_prefix;
} spm_file_info;

/* Pass 1 (t == NULL): count pieces and bytes, read the specs. Pass 2: copy pieces. */
static int spm_file_scan(const unsigned char *buf, size_t size, spm_file_info *info, m40_tokenizer *t)
{
    pb_reader r = {buf, buf + size};
    uint64_t field, val, len;
    int wire;
    const unsigned char *data;
    size_t pos = 0;
    uint64_t i = 0;
    if (!t) {
        memset(info, 0, sizeof *info);
        info->unk = 0;
        info->bos = 1;
        info->eos = 2;
        info->dummy_prefix = 1;
    }
    while (r.p < r.end) {
        if (pbr_field(&r, &field, &wire, &val, &data, &len) != 0)
            return -1;
        if (wire != 2 || field < 1 || field > 3)
            continue;
        pb_reader s = {data, data + len};
        const unsigned char *piece = NULL;
        uint64_t plen = 0, type = M40_TOKEN_NORMAL;
        while (s.p < s.end) {
            uint64_t f, v = 0, l = 0;
            int w;
            const unsigned char *d = NULL;
            if (pbr_field(&s, &f, &w, &v, &d, &l) != 0)
                return -1;
            if (field == 1 && f == 1 && w == 2) {
                piece = d;
                plen = l;
            } else if (field == 1 && f == 3 && w == 0) {
                type = v;
            } else if (field == 2 && w == 0 && !t) {
                if (f == 40)
                    info->unk = (int32_t)(int64_t)v;
                else if (f == 41)
                    info->bos = (int32_t)(int64_t)v;
                else if (f == 42)
                    info->eos = (int32_t)(int64_t)v;
            } else if (field == 3 && f == 3 && w == 0 && !t) {
                info->dummy_prefix = v != 0;
            }
        }
        if (field != 1)
            continue;
        if (!t) {
            if (plen > UINT32_MAX || plen > SIZE_MAX - info->bytes - 1)
                return -1;
            info->bytes += (size_t)plen;
            info->n++;
        } else if (i < (uint64_t)t->n_vocab) {
            tok_set_piece(t, (int32_t)i, &pos, piece ? (const char *)piece : "", (size_t)plen);
            t->types[i] = type >= 1 && type <= 6 ? (uint8_t)type : 0;
            i++;
        }
    }
    return 0;
}

/* Whole file into memory; .model files are a few MB at most. */
static unsigned char *tok_read_file(const char *path, size_t *size, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, len = 0;
    unsigned char *buf = malloc(cap);
    while (buf) {
        if (len == cap) {
            unsigned char *nb = cap <= SIZE_MAX / 2 ? realloc(buf, cap * 2) : NULL;
            if (!nb) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap *= 2;
        }
        size_t got = fread(buf + len, 1, cap - len, f);
        len += got;
        if (got == 0)
            break;
    }
    if (!buf) {
        snprintf(err, errlen, "out of memory reading %s", path);
    } else if (ferror(f)) {
        snprintf(err, errlen, "cannot read %s: %s", path, strerror(errno));
        free(buf);
        buf = NULL;
    }
    fclose(f);
    *size = len;
    return buf;
}

int m40_tokenizer_from_spm_file(const char *path, m40_tokenizer **out, char *err, size_t errlen)
{
    *out = NULL;
    size_t size;
    unsigned char *buf = tok_read_file(path, &size, err, errlen);
    if (!buf)
        return -1;
    m40_tokenizer *t = calloc(1, sizeof *t);
    spm_file_info info;
    if (!t) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    t->kind = M40_TOK_SPM;
    /* Let SentencePiece judge the file first: its message is the most useful one. */
    t->spm = m40_spm_load_proto(buf, size, err, errlen);
    if (!t->spm)
        goto fail;
    if (spm_file_scan(buf, size, &info, NULL) != 0) {
        snprintf(err, errlen, "%s: malformed sentencepiece model", path);
        goto fail;
    }
    if (info.n != (uint64_t)m40_spm_n_pieces(t->spm)) {
        snprintf(err, errlen, "%s: %llu pieces read, sentencepiece has %d", path, (unsigned long long)info.n,
                 m40_spm_n_pieces(t->spm));
        goto fail;
    }
    if (tok_alloc_vocab(t, info.n, info.bytes, err, errlen) != 0 || spm_file_scan(buf, size, &info, t) != 0)
        goto fail;
    free(buf);
    buf = NULL;
    t->unk = info.unk >= 0 && info.unk < t->n_vocab ? info.unk : -1;
    t->bos = info.bos >= 0 && info.bos < t->n_vocab ? info.bos : -1;
    t->eos = info.eos >= 0 && info.eos < t->n_vocab ? info.eos : -1;
    t->eot = -1;
    t->add_bos = 1;
    t->dummy_prefix = info.dummy_prefix;
    if (tok_finish(t, err, errlen) != 0)
        goto fail;
    *out = t;
    return 0;
fail:
    free(buf);
    m40_tokenizer_free(t);
    return -1;
}

/* ---- accessors ---- */

int m40_tokenizer_kind(const m40_tokenizer *t) { return t->kind; }
const char *m40_tokenizer_load_warning(const m40_tokenizer *t) { return t->bpe ? m40_bpe_load_warning(t->bpe) : NULL; }
int32_t m40_tokenizer_n_vocab(const m40_tokenizer *t) { return t->n_vocab; }

size_t m40_tokenizer_max_piece_len(const m40_tokenizer *t) { return t ? t->max_piece_len : 1; }
int32_t m40_tokenizer_bos(const m40_tokenizer *t) { return t->bos; }
int32_t m40_tokenizer_eos(const m40_tokenizer *t) { return t->eos; }
int m40_tokenizer_add_bos(const m40_tokenizer *t) { return t->add_bos && t->bos >= 0; }

int m40_tokenizer_token_type(const m40_tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab ? t->types[id] : 0;
}

int m40_tokenizer_is_eog(const m40_tokenizer *t, int32_t id)
{
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id)
            return 1;
    return 0;
}

const char *m40_tokenizer_piece(const m40_tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab ? t->arena + t->piece_off[id] : NULL;
}

/* ---- encoding ---- */

/* Encodes one plain-text fragment, appending at ids[*count] (nothing written past cap). */
static int tok_encode_text(const m40_tokenizer *t, const char *text, size_t len, int32_t *ids, int64_t cap,
                           int64_t *count, char *err, size_t errlen)
{
    if (len == 0)
        return 0;
    int32_t dummy;
    int32_t *dst = *count < cap ? ids + *count : &dummy;
    int64_t room = *count < cap ? cap - *count : 0;
    int64_t got;
    if (t->kind == M40_TOK_SPM) {
        got = m40_spm_encode(t->spm, text, len, dst, room, err, errlen);
    } else {
        got = m40_bpe_encode(t->bpe, text, len, dst, room);
        if (got < 0)
            snprintf(err, errlen, "byte-level BPE: out of memory encoding %zu bytes", len);
    }
    if (got < 0)
        return -1;
    *count += got;
    return 0;
}

static void tok_emit(int32_t *ids, int64_t cap, int64_t *count, int32_t id)
{
    if (*count < cap)
        ids[*count] = id;
    (*count)++;
}

/* Longest control/user-defined piece (only user-defined ones unless with_control) that
 * starts text[0..len), or -1. */
static int32_t tok_match_special(const m40_tokenizer *t, const char *text, size_t len, int with_control)
{
    unsigned char c = (unsigned char)text[0];
    for (int32_t k = t->special_start[c]; k < t->special_start[c + 1]; k++) {
        int32_t id = t->special[k];
        uint32_t pl = t->piece_len[id];
        if ((with_control || t->types[id] == M40_TOKEN_USER_DEFINED) && pl <= len &&
            !memcmp(text, t->arena + t->piece_off[id], pl))
            return id;
    }
    return -1;
}

/* text cut at special pieces, the rest encoded between them. A special piece may neither
 * start inside a protected range (n_protect pairs [protect[2k], protect[2k+1]), sorted,
 * disjoint) nor reach into one, except a user-defined token wholly inside the range
 * (those match in plain text too): no ranges is parse_special, one range over all of
 * text is plain text. */
static int tok_encode_split(const m40_tokenizer *t, const char *text, size_t len, const size_t *protect,
                            size_t n_protect, int32_t *ids, int64_t cap, int64_t *count, char *err, size_t errlen)
{
    size_t start = 0, r = 0;
    for (size_t i = 0; i < len;) {
        while (r < n_protect && protect[2 * r + 1] <= i)
            r++;
        const int inside = r < n_protect && protect[2 * r] <= i;
        const size_t limit = inside ? protect[2 * r + 1] : r < n_protect ? protect[2 * r] : len;
        const int32_t id = tok_match_special(t, text + i, (limit < len ? limit : len) - i, !inside);
        if (id < 0) {
            i++;
            continue;
        }
        if (tok_encode_text(t, text + start, i - start, ids, cap, count, err, errlen) != 0)
            return -1;
        tok_emit(ids, cap, count, id);
        i += t->piece_len[id];
        start = i;
    }
    return tok_encode_text(t, text + start, len - start, ids, cap, count, err, errlen);
}

int64_t m40_tokenize(const m40_tokenizer *t, const char *text, size_t len, int add_bos, int parse_special,
                     int32_t *ids, int64_t cap, char *err, size_t errlen)
{
    if (!t || (!text && len) || cap < 0 || (!ids && cap > 0)) {
        snprintf(err, errlen, "tokenize: bad arguments");
        return -1;
    }
    int64_t count = 0;
    if (add_bos && t->bos >= 0)
        tok_emit(ids, cap, &count, t->bos);
    /* Without parse_special, SentencePiece splits user-defined pieces itself; BPE needs
     * them split here (the whole text one protected range). */
    int rc;
    const size_t all[2] = {0, len};
    if ((!parse_special && t->kind == M40_TOK_SPM) || t->n_special == 0)
        rc = tok_encode_text(t, text, len, ids, cap, &count, err, errlen);
    else
        rc = tok_encode_split(t, text, len, parse_special ? NULL : all, parse_special ? 0 : 1, ids, cap, &count, err,
                              errlen);
    return rc != 0 ? -1 : count;
}

int64_t m40_tokenize_guarded(const m40_tokenizer *t, const char *text, size_t len, int add_bos,
                             const size_t *protect, size_t n_protect, int32_t *ids, int64_t cap, char *err,
                             size_t errlen)
{
    if (!t || (!text && len) || cap < 0 || (!ids && cap > 0) || (n_protect && !protect)) {
        snprintf(err, errlen, "tokenize: bad arguments");
        return -1;
    }
    int64_t count = 0;
    if (add_bos && t->bos >= 0)
        tok_emit(ids, cap, &count, t->bos);
    const int rc = t->n_special == 0 ? tok_encode_text(t, text, len, ids, cap, &count, err, errlen)
                                     : tok_encode_split(t, text, len, protect, n_protect, ids, cap, &count, err, errlen);
    return rc != 0 ? -1 : count;
}

int m40_tokenizer_has_control(const m40_tokenizer *t, const char *text, size_t len)
{
    if (!t || !text || t->n_special == 0)
        return 0;
    for (size_t i = 0; i < len; i++) {
        const int32_t id = tok_match_special(t, text + i, len - i, 1);
        if (id >= 0 && t->types[id] != M40_TOKEN_USER_DEFINED)
            return 1;
    }
    return 0;
}

/* ---- decoding ---- */

static int tok_copy_out(char *buf, int cap, const char *s, size_t len)
{
    if (len > INT32_MAX)
        len = INT32_MAX;
    if (cap > 0)
        memcpy(buf, s, len < (size_t)cap ? len : (size_t)cap);
    return (int)len;
}

static int tok_hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

int m40_token_to_bytes(const m40_tokenizer *t, int32_t id, int render_special, char *buf, int cap)
{
    if (!t || id < 0 || id >= t->n_vocab)
        return 0;
    if (!buf)
        cap = 0;
    uint32_t len;
    const char *p = tok_piece(t, id, &len);
    int type = t->types[id];
    if (type == M40_TOKEN_CONTROL) {
        for (int i = 0; i < t->n_rendered && !render_special; i++)
            render_special = t->rendered[i] == id;
        return render_special ? tok_copy_out(buf, cap, p, len) : 0;
    }
    if (type == M40_TOKEN_UNKNOWN && id == t->unk && t->kind == M40_TOK_SPM)
        return render_special ? tok_copy_out(buf, cap, p, len)
                              : tok_copy_out(buf, cap, M40_SPM_UNK_SURFACE, sizeof M40_SPM_UNK_SURFACE - 1);
    if (t->kind == M40_TOK_BPE) {
        /* Added (user-defined) tokens are stored as plain text, not byte-level mapped. */
        if (type == M40_TOKEN_USER_DEFINED)
            return tok_copy_out(buf, cap, p, len);
        int r = m40_bpe_token_bytes(t->bpe, id, buf, cap);
        return r < 0 ? 0 : r;
    }
    if (type == M40_TOKEN_BYTE && len == 6 && !memcmp(p, "<0x", 3) && p[5] == '>' && tok_hexval(p[3]) >= 0 &&
        tok_hexval(p[4]) >= 0) {
        if (cap > 0)
            buf[0] = (char)(tok_hexval(p[3]) * 16 + tok_hexval(p[4]));
        return 1;
    }
    /* SentencePiece piece: every U+2581 stands for a space. */
    size_t n = 0;
    for (uint32_t i = 0; i < len;) {
        char c;
        if (len - i >= 3 && !memcmp(p + i, M40_SPM_SPACE, 3)) {
            c = ' ';
            i += 3;
        } else {
            c = p[i++];
        }
        if (n < (size_t)cap)
            buf[n] = c;
        n++;
    }
    return (int)n;
}

/* ---- streaming detokenizer ----
 * Token bytes are appended to pend; the longest prefix of complete UTF-8 sequences
 * (invalid bytes replaced by U+FFFD, one per maximal ill-formed subpart, as Unicode
 * recommends) is moved to out; a valid but incomplete tail (at most 3 bytes) waits.
 *
 * SPM leading space: SentencePiece decoding drops the ▁ prefix of the first text piece
 * (the dummy prefix encoding added). Here that is the first token that yields bytes
 * while nothing but control tokens (e.g. BOS) came before it. To stream a continuation
 * without losing its first space, push the last prompt token first and discard what it
 * returns. */
struct m40_detok {
    const m40_tokenizer *t;
    int started;        /* a text token was seen */
    char pend[4];       /* held incomplete UTF-8 tail, at most 3 bytes */
    int npend;
    char *out;          /* text completed by the last call */
    size_t out_len, out_cap;
    char *join;         /* held tail + the new token's bytes */
    size_t join_cap;
};

m40_detok *m40_detok_new(const m40_tokenizer *t)
{
    if (!t)
        return NULL;
    m40_detok *d = calloc(1, sizeof *d);
    if (!d)
        return NULL;
    d->t = t;
    return d;
}

void m40_detok_free(m40_detok *d)
{
    if (!d)
        return;
    free(d->out);
    free(d->join);
    free(d);
}

static int detok_out(m40_detok *d, const char *s, size_t n)
{
    if (d->out_len + n > d->out_cap) {
        size_t cap = d->out_cap ? d->out_cap : 64;
        while (cap < d->out_len + n)
            cap *= 2;
        char *o = realloc(d->out, cap);
        if (!o)
            return -1;
        d->out = o;
        d->out_cap = cap;
    }
    memcpy(d->out + d->out_len, s, n);
    d->out_len += n;
    return 0;
}

/* Length of the UTF-8 sequence at s[0..n): >0 complete and valid; 0 valid so far but
 * incomplete; -k an ill-formed subpart of k bytes to replace by one U+FFFD. */
static int utf8_seq(const unsigned char *s, size_t n)
{
    unsigned char c = s[0];
    int need;
    unsigned char lo = 0x80, hi = 0xBF; /* range of the second byte */
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF)
        need = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        need = 3;
        if (c == 0xE0)
            lo = 0xA0;
        if (c == 0xED)
            hi = 0x9F; /* no surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 4;
        if (c == 0xF0)
            lo = 0x90;
        if (c == 0xF4)
            hi = 0x8F; /* nothing past U+10FFFF */
    } else
        return -1;
    for (int i = 1; i < need; i++) {
        if ((size_t)i >= n)
            return 0;
        unsigned char b = s[i];
        unsigned char l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
        if (b < l || b > h)
            return -i;
    }
    return need;
}

/* Moves complete sequences from src into out; returns the bytes left (an incomplete
 * tail) or -1 when out of memory. With final, the tail becomes U+FFFD too. */
static int detok_drain(m40_detok *d, const unsigned char *src, size_t n, int final, size_t *used)
{
    size_t i = 0;
    while (i < n) {
        int k = utf8_seq(src + i, n - i);
        if (k > 0) {
            if (detok_out(d, (const char *)src + i, (size_t)k) != 0)
                return -1;
            i += (size_t)k;
        } else if (k < 0 || final) {
            if (detok_out(d, "\xef\xbf\xbd", 3) != 0)
                return -1;
            i += k < 0 ? (size_t)-k : n - i;
        } else {
            break;
        }
    }
    *used = i;
    return 0;
}

static int detok_join_reserve(m40_detok *d, size_t need)
{
    if (need <= d->join_cap)
        return 0;
    size_t cap = d->join_cap ? d->join_cap : 64;
    while (cap < need)
        cap *= 2;
    char *j = realloc(d->join, cap);
    if (!j)
        return -1;
    d->join = j;
    d->join_cap = cap;
    return 0;
}

/* join[0..npend) holds the old tail and join[npend..total) the new bytes. */
static const char *detok_feed(m40_detok *d, size_t total, int final, size_t *n)
{
    size_t used;
    d->out_len = 0;
    if (detok_drain(d, (const unsigned char *)d->join, total, final, &used) != 0)
        return NULL;
    d->npend = (int)(total - used); /* <= 3: utf8_seq only waits on a valid prefix */
    memcpy(d->pend, d->join + used, (size_t)d->npend);
    *n = d->out_len;
    return d->out ? d->out : "";
}

const char *m40_detok_push(m40_detok *d, int32_t id, size_t *n)
{
    *n = 0;
    if (!d || detok_join_reserve(d, 64) != 0)
        return NULL;
    size_t np = (size_t)d->npend;
    memcpy(d->join, d->pend, np);
    int len = m40_token_to_bytes(d->t, id, 0, d->join + np, (int)(d->join_cap - np));
    if ((size_t)len > d->join_cap - np) {
        if (detok_join_reserve(d, np + (size_t)len) != 0)
            return NULL;
        len = m40_token_to_bytes(d->t, id, 0, d->join + np, (int)(d->join_cap - np));
    }
    if (len > 0 && !d->started) {
        d->started = 1;
        /* SentencePiece drops the dummy-prefix space of the first piece (a byte token
         * is the text itself, not a piece with a prefix). */
        if (d->t->kind == M40_TOK_SPM && d->t->dummy_prefix && d->join[np] == ' ' &&
            m40_tokenizer_token_type(d->t, id) != M40_TOKEN_BYTE) {
            memmove(d->join + np, d->join + np + 1, (size_t)len - 1);
            len--;
        }
    }
    return detok_feed(d, np + (size_t)len, 0, n);
}

const char *m40_detok_flush(m40_detok *d, size_t *n)
{
    *n = 0;
    if (!d || detok_join_reserve(d, 4) != 0)
        return NULL;
    memcpy(d->join, d->pend, (size_t)d->npend);
    return detok_feed(d, (size_t)d->npend, 1, n);
}
