/* Byte-level BPE ("gpt2" tokenizer model).
 *
 * Pipeline of m40_bpe_encode:
 *   1. pre-tokenize: the pre-tokenizer of tokenizer.ggml.pre is a sequence of PCRE2
 *      regexes. Each regex splits every chunk left by the previous one into its matches
 *      and the unmatched text between them (both kept, in order: the "isolated" split of
 *      the reference tokenizers). A chunk is its own subject, so anchors and lookarounds
 *      never see past it. The walk is recursive (regex k hands each piece to regex k+1),
 *      so no chunk list is ever materialised.
 *   2. each final chunk ("word") starts as one symbol per byte, the symbol being the
 *      token of that byte's GPT-2 byte-to-unicode character.
 *   3. merges are applied lowest rank first (ties: leftmost first) with a binary heap of
 *      candidate pairs, validated lazily when popped: O(n log n) per word.
 *   4. a symbol that is no vocabulary token (a merge result missing from the vocab)
 *      falls back to the tokens of its bytes.
 *
 * Everything works on interned piece ids instead of strings: every vocab token is a
 * piece (piece id == token id), and merge operands/results missing from the vocab get
 * extra piece ids >= n_vocab. A merge is then a map (left id, right id) -> (rank, result
 * id), which makes the inner loop free of string handling.
 *
 * Invalid UTF-8 is compiled away by PCRE2_MATCH_INVALID_UTF: no regex can match an
 * invalid sequence, so such bytes end up in the unmatched pieces and are encoded
 * bytewise like any other byte. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "bpe.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/err.h" /* m40_set_err */
#include "util/hash.h"

/* ---------------------------------------------------------------------------------- */
/* Pre-tokenizer regexes (public definitions of the model families' pre-tokenizers).   */

/* GPT-2: contractions, optionally space-prefixed letter/number/other runs, and
 * whitespace not followed by a non-space. Its trailing "\s+" alternative is not needed:
 * whatever no alternative matches becomes an unmatched piece of its own anyway. */
#define RE_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"

/* Contractions matched case-insensitively, spelled out per letter so that Unicode case
 * folding (e.g. U+017F long s ~ 's') cannot widen them. */
#define RE_CONTRACTIONS_CI "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

/* Llama 3 (also dbrx, smaug, chatglm4): numbers in groups of at most 3 digits. */
#define RE_LLAMA3                                                                          \
    RE_CONTRACTIONS_CI "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*" \
                       "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

/* Qwen2 (also stablelm2, megrez, hunyuan, grok-2): like Llama 3 with single digits. */
#define RE_QWEN2                                                                           \
    RE_CONTRACTIONS_CI "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"     \
                       "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

/* CJK ideographs, U+0800.., Hangul: the CJK runs of the DeepSeek pre-tokenizers. */
#define RE_DEEPSEEK_CJK "[\\x{4E00}-\\x{9FA5}\\x{0800}-\\x{4E00}\\x{AC00}-\\x{D7FF}]+"

/* DeepSeek LLM letters: its tokenizer lists cased letters explicitly (a subset of
 * \p{L&} frozen at an older Unicode version), so the class is spelled out here. */
#define RE_DEEPSEEK_LLM_LETTERS                                                            \
    "\\s?[A-Za-z\\x{B5}\\x{C0}-\\x{D6}\\x{D8}-\\x{F6}\\x{F8}-\\x{1BA}\\x{1BC}-\\x{1BF}"        \
    "\\x{1C4}-\\x{293}\\x{295}-\\x{2AF}\\x{370}-\\x{373}\\x{376}\\x{377}\\x{37B}-\\x{37D}"     \
    "\\x{37F}\\x{386}\\x{388}-\\x{38A}\\x{38C}\\x{38E}-\\x{3A1}\\x{3A3}-\\x{3F5}"              \
    "\\x{3F7}-\\x{481}\\x{48A}-\\x{52F}\\x{531}-\\x{556}\\x{10A0}-\\x{10C5}\\x{13A0}-\\x{13F5}" \
    "\\x{13F8}-\\x{13FD}\\x{1C90}-\\x{1CBA}\\x{1CBD}-\\x{1CBF}\\x{1D00}-\\x{1D2B}"             \
    "\\x{1D6B}-\\x{1D77}\\x{1D79}-\\x{1D9A}\\x{1E00}-\\x{1F15}\\x{1F18}-\\x{1F1D}"             \
    "\\x{1F20}-\\x{1F45}\\x{1F48}-\\x{1F4D}\\x{1F50}-\\x{1F57}\\x{1F59}\\x{1F5B}\\x{1F5D}"     \
    "\\x{1F5F}-\\x{1F7D}\\x{1F80}-\\x{1FB4}\\x{1FB6}-\\x{1FBC}\\x{1FBE}\\x{1FC2}-\\x{1FC4}"    \
    "\\x{1FC6}-\\x{1FCC}\\x{1FD0}-\\x{1FD3}\\x{1FD6}-\\x{1FDB}\\x{1FE0}-\\x{1FEC}"             \
    "\\x{1FF2}-\\x{1FF4}\\x{1FF6}-\\x{1FFC}\\x{2102}\\x{2107}\\x{210A}-\\x{2113}\\x{2115}"     \
    "\\x{2119}-\\x{211D}\\x{2124}\\x{2126}\\x{2128}\\x{212A}-\\x{212D}\\x{212F}-\\x{2134}"     \
    "\\x{2139}\\x{213C}-\\x{213F}\\x{2145}-\\x{2149}\\x{214E}\\x{2183}\\x{2184}"               \
    "\\x{2C00}-\\x{2C7B}\\x{2C7E}-\\x{2CE4}\\x{2CEB}-\\x{2CEE}\\x{2CF2}\\x{2CF3}"              \
    "\\x{A640}-\\x{A66D}\\x{A680}-\\x{A69B}\\x{A722}-\\x{A76F}\\x{A771}-\\x{A787}"             \
    "\\x{A78B}-\\x{A78E}\\x{AB70}-\\x{ABBF}\\x{FB00}-\\x{FB06}\\x{FB13}-\\x{FB17}"             \
    "\\x{FF21}-\\x{FF3A}\\x{FF41}-\\x{FF5A}\\x{10400}-\\x{1044F}\\x{104B0}-\\x{104D3}"         \
    "\\x{104D8}-\\x{104FB}\\x{10C80}-\\x{10CB2}\\x{10CC0}-\\x{10CF2}\\x{118A0}-\\x{118DF}"     \
    "\\x{1E900}-\\x{1E943}]+"

/* BLOOM / Poro / GPT-3 Finnish: everything up to whitespace or the listed punctuation
 * (the parentheses and '|' inside the class are literal members, as in the original). */
#define RE_PORO " ?[^(\\s|.,!?\\x{2026}\\x{3002}\\x{FF0C}\\x{3001}\\x{0964}\\x{06D4}\\x{060C})]+"

/* Case-split words: an optional non-letter, then upper-case letters followed by
 * lower-case ones (or the reverse shape); marks and Lm/Lo count as both. */
#define RE_CASED_WORD_A "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
#define RE_CASED_WORD_B "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"

static const char *const re_gpt2[] = {RE_GPT2, NULL};
static const char *const re_llama3[] = {RE_LLAMA3, NULL};
static const char *const re_qwen2[] = {RE_QWEN2, NULL};
static const char *const re_deepseek_llm[] = {
    "[\\r\\n]", RE_DEEPSEEK_LLM_LETTERS,
    "\\s?[!-/:-~\\x{FF01}-\\x{FF0F}\\x{FF1A}-\\x{FF5E}\\x{2018}-\\x{201F}\\x{3000}-\\x{3002}]+",
    "\\s+$", RE_DEEPSEEK_CJK, "\\p{N}+", NULL};
static const char *const re_deepseek_coder[] = {
    "[\\r\\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", RE_DEEPSEEK_CJK, "\\p{N}", NULL};
static const char *const re_deepseek3[] = {
    "\\p{N}{1,3}", "[\\x{4E00}-\\x{9FA5}\\x{3040}-\\x{309F}\\x{30A0}-\\x{30FF}]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    NULL};
/* llama.cpp's fallback for byte-level BPE files without tokenizer.ggml.pre (its pre-type
 * "default"; a file whose value is "default" gets it too). Files converted before the
 * key existed (GPT-NeoX, early Llama 3 quantizations, ...) load with it in llama.cpp and
 * Ollama, so their users' token ids are these, not the GPT-2 regex alone. The steps:
 * runs of punctuation (Unicode P plus the ASCII symbols $ + < = > ^ ~ |; unlike falcon's
 * list, not the backtick) are isolated first, so "don't" never forms the contraction
 * "'t"; the GPT-2 regex splits what is left; number runs lose their leading space; ASCII
 * digit runs are cut into threes from the left ("12345" -> "123" "45"). */
static const char *const re_default[] = {
    "[\\p{P}\\$\\+<=>\\^~\\|]+", RE_GPT2, "\\p{N}+", "[0-9][0-9][0-9]", NULL};
static const char *const re_falcon[] = {"[\\p{P}\\$\\+<=>\\^~\\|`]+", RE_GPT2, "[0-9][0-9][0-9]", NULL};
static const char *const re_starcoder[] = {"\\p{N}", RE_GPT2, NULL};
static const char *const re_poro[] = {RE_PORO, NULL};
static const char *const re_viking[] = {RE_PORO, "\\p{N}", NULL};
static const char *const re_tekken[] = {
    RE_CASED_WORD_A "|" RE_CASED_WORD_B "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    NULL};
static const char *const re_chameleon[] = {
    "<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )", "\\p{N}",
    "[\\p{P}!-/:-@\\[-`{-~]", RE_GPT2, NULL};
static const char *const re_gpt4o[] = {
    RE_CASED_WORD_A RE_CONTRACTIONS_CI "?|" RE_CASED_WORD_B RE_CONTRACTIONS_CI
    "?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    NULL};
/* SuperBPE: digit runs, then split them into groups of three from the right. Its
 * tokenizer states the second step as the zero-width split "(?=(\d{3})+(?!\d))", whose
 * lookahead rescans the rest of the run at every position: quadratic, so a long digit
 * string would stall the engine. The step is done here by a linear walk instead
 * (M40_BPE_DIGIT_GROUPS: find each \d+ run, cut it so that every group but the first
 * has three digits), which yields the same pieces. */
static const char M40_BPE_DIGIT_GROUPS[] = "\\d+";
static const char *const re_superbpe[] = {"\\p{N}+", M40_BPE_DIGIT_GROUPS, NULL};
static const char *const re_bailingmoe[] = {
    "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?+\\p{L}+|\\p{N}"
    "| ?[^\\s\\p{L}\\p{N}]++[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
    NULL};
static const char *const re_seed_coder[] = {
    RE_CONTRACTIONS_CI "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+"
                       "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    NULL};

typedef struct {
    const char *name;
    const char *const *regexes;
    /* The whole word is looked up before merging (Llama 3 style "ignore_merges"): a
     * word that is itself a token is emitted as that token even when the merges would
     * not build it. */
    int ignore_merges;
} m40_bpe_pre_def;

static const m40_bpe_pre_def m40_bpe_pres[] = {
    /* "default": also what a missing tokenizer.ggml.pre means (see m40_bpe_new). */
    {"default", re_default, 0},      {"gpt2", re_gpt2, 0},           {"gpt-2", re_gpt2, 0},
    {"gpt-neox", re_gpt2, 0},        {"phi-2", re_gpt2, 0},          {"mpt", re_gpt2, 0},
    {"olmo", re_gpt2, 0},            {"jais", re_gpt2, 0},           {"trillion", re_gpt2, 0},
    {"granite-docling", re_gpt2, 0}, {"exaone4", re_gpt2, 0},        {"jina-es", re_gpt2, 0},
    {"jina-de", re_gpt2, 0},         {"jina-v1-en", re_gpt2, 0},     {"jina-v2-es", re_gpt2, 0},
    {"jina-v2-de", re_gpt2, 0},      {"jina-v2-code", re_gpt2, 0},   {"gigachat", re_gpt2, 0},
    {"roberta-bpe", re_gpt2, 0},     {"a.x-4.0", re_gpt2, 0},        {"mellum", re_gpt2, 0},
    {"modern-bert", re_gpt2, 0},
    {"llama3", re_llama3, 1},        {"llama-v3", re_llama3, 1},     {"llama-bpe", re_llama3, 1},
    {"falcon3", re_llama3, 1},       {"falcon-h1", re_llama3, 1},    {"pixtral", re_llama3, 1},
    {"midm-2.0", re_llama3, 1},      {"lfm2", re_llama3, 1},
    {"dbrx", re_llama3, 0},          {"smaug-bpe", re_llama3, 0},    {"chatglm-bpe", re_llama3, 0},
    {"glm4", re_llama3, 0},
    {"deepseek-llm", re_deepseek_llm, 0},
    {"deepseek-coder", re_deepseek_coder, 0},
    {"deepseek-v3", re_deepseek3, 0}, {"hunyuan-dense", re_deepseek3, 0},
    {"falcon", re_falcon, 0},
    {"starcoder", re_starcoder, 0},  {"refact", re_starcoder, 0},    {"command-r", re_starcoder, 0},
    {"smollm", re_starcoder, 0},     {"codeshell", re_starcoder, 0}, {"exaone", re_starcoder, 0},
    {"minerva-7b", re_starcoder, 0},
    {"qwen2", re_qwen2, 0},          {"deepseek-r1-qwen", re_qwen2, 0}, {"megrez", re_qwen2, 0},
    {"stablelm2", re_qwen2, 0},      {"hunyuan", re_qwen2, 0},       {"grok-2", re_qwen2, 0},
    {"poro-chat", re_poro, 0},       {"bloom", re_poro, 0},          {"gpt3-finnish", re_poro, 0},
    {"viking", re_viking, 0},
    {"tekken", re_tekken, 1},
    {"chameleon", re_chameleon, 0},
    {"gpt-4o", re_gpt4o, 0},         {"llama4", re_gpt4o, 0},        {"minimax-m2", re_gpt4o, 0},
    {"superbpe", re_superbpe, 0},
    {"bailingmoe", re_bailingmoe, 0}, {"bailingmoe2", re_bailingmoe, 0}, {"llada-moe", re_bailingmoe, 0},
    {"seed-coder", re_seed_coder, 0},
};

#define M40_BPE_MAX_REGEX 8

/* ---------------------------------------------------------------------------------- */
/* Data structures.                                                                    */

typedef struct {
    uint32_t off; /* into the arena */
    uint32_t len;
} m40_bpe_piece;

typedef struct {
    uint64_t key; /* (left << 32) | right; UINT64_MAX = empty slot */
    int32_t rank;
    int32_t result;
} m40_bpe_merge_slot;

struct m40_bpe {
    char pre[64];
    char load_warning[256]; /* "" when the file needed no fallback */
    int ignore_merges;
    int n_regex;
    pcre2_code *re[M40_BPE_MAX_REGEX];
    unsigned char digit_groups[M40_BPE_MAX_REGEX]; /* step k is the SuperBPE digit grouping */

    int32_t n_vocab;
    /* 1 for control and user-defined tokens: their strings are plain text, not
     * byte-mapped, so token_bytes returns them as stored. */
    unsigned char *raw;
    int32_t n_pieces, cap_pieces;
    m40_bpe_piece *pieces;
    char *arena;
    size_t arena_len, arena_cap;

    /* piece string -> piece id, open addressing; -1 = empty */
    int32_t *str_slots;
    size_t str_mask;

    m40_bpe_merge_slot *merge_slots;
    size_t merge_mask;

    int32_t byte_piece[256];      /* piece of each byte's mapped character */
    uint16_t byte_to_cp[256];     /* GPT-2 byte -> code point */
    int16_t cp_to_byte[324];      /* inverse, -1 where no byte maps there */
};

/* GPT-2's byte-to-unicode table: printable Latin-1 bytes stand for themselves, the
 * other 68 bytes are moved, in order, to U+0100.. so every byte is a visible char. */
static int m40_bpe_byte_is_self(int b)
{
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

static void m40_bpe_init_bytemap(m40_bpe *b)
{
    int next = 256;
    for (int i = 0; i < 324; i++)
        b->cp_to_byte[i] = -1;
    for (int i = 0; i < 256; i++) {
        int cp = m40_bpe_byte_is_self(i) ? i : next++;
        b->byte_to_cp[i] = (uint16_t)cp;
        b->cp_to_byte[cp] = (int16_t)i;
    }
}

static uint64_t m40_bpe_hash_bytes(const char *s, size_t n)
{
    const uint64_t h = m40_fnv1a64(s, n);
    return h ^ (h >> 29);
}

static uint64_t m40_bpe_hash_u64(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

static int32_t m40_bpe_find_piece(const m40_bpe *b, const char *s, size_t n)
{
    size_t i = m40_bpe_hash_bytes(s, n) & b->str_mask;
    for (;;) {
        int32_t id = b->str_slots[i];
        if (id < 0)
            return -1;
        const m40_bpe_piece *p = &b->pieces[id];
        if (p->len == n && memcmp(b->arena + p->off, s, n) == 0)
            return id;
        i = (i + 1) & b->str_mask;
    }
}

/* Grow-by-doubling of the string table; the load factor stays at most 1/2. */
static int m40_bpe_str_rehash(m40_bpe *b, size_t new_cap)
{
    int32_t *slots = malloc(new_cap * sizeof *slots);
    if (!slots)
        return -1;
    for (size_t i = 0; i < new_cap; i++)
        slots[i] = -1;
    size_t mask = new_cap - 1;
    for (int32_t id = 0; id < b->n_pieces; id++) {
        const m40_bpe_piece *p = &b->pieces[id];
        size_t i = m40_bpe_hash_bytes(b->arena + p->off, p->len) & mask;
        while (slots[i] >= 0)
            i = (i + 1) & mask;
        slots[i] = id;
    }
    free(b->str_slots);
    b->str_slots = slots;
    b->str_mask = mask;
    return 0;
}

/* Returns the id of string s (existing, or a new piece when allow_dup or absent);
 * -1 on allocation failure or overflow. Vocabulary tokens are added with allow_dup so
 * that piece id == token id even when a token string repeats; lookups then find the
 * first (lowest) id of that string. */
static int32_t m40_bpe_intern(m40_bpe *b, const char *s, size_t n, int allow_dup)
{
    if (!allow_dup) {
        int32_t id = m40_bpe_find_piece(b, s, n);
        if (id >= 0)
            return id;
    }
    if (n > UINT32_MAX || b->n_pieces == INT32_MAX)
        return -1;
    if ((size_t)(b->n_pieces + 1) * 2 > b->str_mask + 1)
        if (m40_bpe_str_rehash(b, (b->str_mask + 1) * 2) != 0)
            return -1;
    if (b->n_pieces == b->cap_pieces) {
        int32_t cap = b->cap_pieces > INT32_MAX / 2 ? INT32_MAX : b->cap_pieces * 2;
        m40_bpe_piece *np = realloc(b->pieces, (size_t)cap * sizeof *np);
        if (!np)
            return -1;
        b->pieces = np;
        b->cap_pieces = cap;
    }
    if (b->arena_len + n > b->arena_cap) {
        size_t cap = b->arena_cap * 2;
        if (cap < b->arena_len + n)
            cap = b->arena_len + n;
        if (cap > UINT32_MAX)
            return -1;
        char *na = realloc(b->arena, cap);
        if (!na)
            return -1;
        b->arena = na;
        b->arena_cap = cap;
    }
    int32_t id = b->n_pieces++;
    b->pieces[id].off = (uint32_t)b->arena_len;
    b->pieces[id].len = (uint32_t)n;
    if (n)
        memcpy(b->arena + b->arena_len, s, n);
    b->arena_len += n;
    /* Only insert when absent: duplicates keep the first id reachable by lookup. */
    if (m40_bpe_find_piece(b, s, n) < 0) {
        size_t i = m40_bpe_hash_bytes(s, n) & b->str_mask;
        while (b->str_slots[i] >= 0)
            i = (i + 1) & b->str_mask;
        b->str_slots[i] = id;
    }
    return id;
}

static const m40_bpe_merge_slot *m40_bpe_find_merge(const m40_bpe *b, int32_t l, int32_t r)
{
    uint64_t key = ((uint64_t)(uint32_t)l << 32) | (uint32_t)r;
    size_t i = m40_bpe_hash_u64(key) & b->merge_mask;
    for (;;) {
        const m40_bpe_merge_slot *s = &b->merge_slots[i];
        if (s->key == key)
            return s;
        if (s->key == UINT64_MAX)
            return NULL;
        i = (i + 1) & b->merge_mask;
    }
}

static size_t m40_bpe_utf8_put(char *out, uint32_t cp)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    /* The byte map never goes past U+0143, so two bytes suffice. */
    out[0] = (char)(0xC0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
}

/* ---------------------------------------------------------------------------------- */
/* Construction.                                                                       */

m40_bpe *m40_bpe_new(const m40_gguf *g, char *err, size_t errlen)
{
    if (err && errlen)
        err[0] = '\0';
    /* A missing or empty tokenizer.ggml.pre is what llama.cpp reads as its "default"
     * pre-tokenizer (with a warning): doing the same gives such files the token ids
     * their llama.cpp and Ollama users get. A value that is not a string is a broken
     * file, not a missing key. */
    const char *pre = m40_gguf_get_str(g, "tokenizer.ggml.pre");
    if (!pre && m40_gguf_get(g, "tokenizer.ggml.pre")) {
        m40_set_err(err, errlen, "tokenizer.ggml.pre is not a string");
        return NULL;
    }
    const char *pre_missing = !pre ? "missing" : !*pre ? "empty" : NULL;
    if (pre_missing)
        pre = "default";
    const m40_bpe_pre_def *def = NULL;
    for (size_t i = 0; i < sizeof m40_bpe_pres / sizeof m40_bpe_pres[0]; i++)
        if (strcmp(m40_bpe_pres[i].name, pre) == 0)
            def = &m40_bpe_pres[i];
    if (!def) {
        m40_set_err(err, errlen, "unknown tokenizer.ggml.pre '%.100s'", pre);
        return NULL;
    }
    const m40_gguf_value *toks = m40_gguf_get_arr(g, "tokenizer.ggml.tokens", M40_GGUF_STRING);
    if (!toks) {
        m40_set_err(err, errlen, "missing or non-string tokenizer.ggml.tokens");
        return NULL;
    }
    if (toks->v.arr.n == 0 || toks->v.arr.n > (uint64_t)INT32_MAX / 2) {
        m40_set_err(err, errlen, "bad vocabulary size %llu", (unsigned long long)toks->v.arr.n);
        return NULL;
    }
    const m40_gguf_value *merges = m40_gguf_get_arr(g, "tokenizer.ggml.merges", M40_GGUF_STRING);
    if (!merges) {
        m40_set_err(err, errlen, "missing or non-string tokenizer.ggml.merges");
        return NULL;
    }
    if (merges->v.arr.n > (uint64_t)INT32_MAX / 4) {
        m40_set_err(err, errlen, "too many merges: %llu", (unsigned long long)merges->v.arr.n);
        return NULL;
    }

    m40_bpe *b = calloc(1, sizeof *b);
    if (!b) {
        m40_set_err(err, errlen, "out of memory");
        return NULL;
    }
    snprintf(b->pre, sizeof b->pre, "%s", pre);
    if (pre_missing)
        snprintf(b->load_warning, sizeof b->load_warning,
                 "tokenizer.ggml.pre is %s: using llama.cpp's fallback pre-tokenizer \"default\" "
                 "(token ids match llama.cpp and Ollama, but may differ from the model's own "
                 "tokenizer; a current GGUF conversion names the right one)",
                 pre_missing);
    b->ignore_merges = def->ignore_merges;
    m40_bpe_init_bytemap(b);

    int32_t n_vocab = (int32_t)toks->v.arr.n;
    size_t arena = 0;
    for (int32_t i = 0; i < n_vocab; i++)
        arena += toks->v.arr.items[i].v.str.len;
    if (arena > UINT32_MAX / 2) {
        m40_set_err(err, errlen, "vocabulary strings too large (%zu bytes)", arena);
        goto fail;
    }
    b->arena_cap = arena + 4096;
    b->cap_pieces = n_vocab + 1024;
    size_t slots = 1024;
    while (slots < (size_t)n_vocab * 2 + 2048)
        slots *= 2;
    b->arena = malloc(b->arena_cap);
    b->pieces = malloc((size_t)b->cap_pieces * sizeof *b->pieces);
    b->str_slots = malloc(slots * sizeof *b->str_slots);
    if (!b->arena || !b->pieces || !b->str_slots) {
        m40_set_err(err, errlen, "out of memory");
        goto fail;
    }
    for (size_t i = 0; i < slots; i++)
        b->str_slots[i] = -1;
    b->str_mask = slots - 1;

    for (int32_t i = 0; i < n_vocab; i++) {
        const m40_gguf_value *t = &toks->v.arr.items[i];
        if (m40_bpe_intern(b, t->v.str.ptr, t->v.str.len, 1) != i) {
            m40_set_err(err, errlen, "out of memory interning token %d", (int)i);
            goto fail;
        }
    }
    b->n_vocab = n_vocab;

    const m40_gguf_value *types = m40_gguf_get_arr(g, "tokenizer.ggml.token_type", M40_GGUF_INT32);
    b->raw = calloc((size_t)n_vocab, 1);
    if (!b->raw) {
        m40_set_err(err, errlen, "out of memory");
        goto fail;
    }
    /* Absent or mis-sized types: every token is treated as byte-mapped text. */
    if (types && types->v.arr.n == (uint64_t)n_vocab)
        for (int32_t i = 0; i < n_vocab; i++) {
            int64_t t = types->v.arr.items[i].v.i64;
            b->raw[i] = t == 3 || t == 4; /* CONTROL, USER_DEFINED */
        }

    for (int i = 0; i < 256; i++) {
        char s[2];
        size_t n = m40_bpe_utf8_put(s, b->byte_to_cp[i]);
        b->byte_piece[i] = m40_bpe_intern(b, s, n, 0);
        if (b->byte_piece[i] < 0) {
            m40_set_err(err, errlen, "out of memory");
            goto fail;
        }
    }

    size_t mcap = 1024;
    while (mcap < merges->v.arr.n * 2 + 2)
        mcap *= 2;
    b->merge_slots = malloc(mcap * sizeof *b->merge_slots);
    if (!b->merge_slots) {
        m40_set_err(err, errlen, "out of memory for %llu merges", (unsigned long long)merges->v.arr.n);
        goto fail;
    }
    for (size_t i = 0; i < mcap; i++)
        b->merge_slots[i].key = UINT64_MAX;
    b->merge_mask = mcap - 1;

    char *cat = NULL;
    size_t cat_cap = 0;
    for (uint64_t r = 0; r < merges->v.arr.n; r++) {
        const char *s = merges->v.arr.items[r].v.str.ptr;
        size_t n = merges->v.arr.items[r].v.str.len;
        /* Split at the first space after the first byte: the left operand is never
         * empty, so a piece that starts with a space byte still parses. */
        const char *sp = n > 1 ? memchr(s + 1, ' ', n - 1) : NULL;
        if (!sp) {
            free(cat);
            m40_set_err(err, errlen, "tokenizer.ggml.merges[%llu] is not of the form 'left right'", (unsigned long long)r);
            goto fail;
        }
        size_t ln = (size_t)(sp - s), rn = n - ln - 1;
        if (ln + rn > cat_cap) {
            char *nc = realloc(cat, ln + rn);
            if (!nc) {
                free(cat);
                m40_set_err(err, errlen, "out of memory");
                goto fail;
            }
            cat = nc;
            cat_cap = ln + rn;
        }
        memcpy(cat, s, ln);
        memcpy(cat + ln, sp + 1, rn);
        int32_t l = m40_bpe_intern(b, s, ln, 0);
        int32_t rt = l < 0 ? -1 : m40_bpe_intern(b, sp + 1, rn, 0);
        int32_t res = rt < 0 ? -1 : m40_bpe_intern(b, cat, ln + rn, 0);
        if (res < 0) {
            free(cat);
            m40_set_err(err, errlen, "out of memory interning merge %llu", (unsigned long long)r);
            goto fail;
        }
        uint64_t key = ((uint64_t)(uint32_t)l << 32) | (uint32_t)rt;
        size_t i = m40_bpe_hash_u64(key) & b->merge_mask;
        while (b->merge_slots[i].key != UINT64_MAX && b->merge_slots[i].key != key)
            i = (i + 1) & b->merge_mask;
        if (b->merge_slots[i].key == UINT64_MAX) { /* a repeated pair keeps its best rank */
            b->merge_slots[i].key = key;
            b->merge_slots[i].rank = (int32_t)r;
            b->merge_slots[i].result = res;
        }
    }
    free(cat);

    for (const char *const *re = def->regexes; *re; re++) {
        if (b->n_regex == M40_BPE_MAX_REGEX) {
            m40_set_err(err, errlen, "pre-tokenizer '%s' has more than %d regexes", pre, M40_BPE_MAX_REGEX);
            goto fail;
        }
        int ec;
        PCRE2_SIZE eo;
        pcre2_code *code = pcre2_compile((PCRE2_SPTR)*re, PCRE2_ZERO_TERMINATED,
                                         PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | PCRE2_DOLLAR_ENDONLY,
                                         &ec, &eo, NULL);
        if (!code) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(ec, msg, sizeof msg);
            if (err && errlen)
                snprintf(err, errlen, "pre-tokenizer '%s' regex %d: %s at offset %zu", pre, b->n_regex,
                         (const char *)msg, (size_t)eo);
            goto fail;
        }
        /* JIT is a speed-up only: when unavailable the interpreter is used. */
        (void)pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
        b->digit_groups[b->n_regex] = *re == M40_BPE_DIGIT_GROUPS;
        b->re[b->n_regex++] = code;
    }
    return b;

fail:
    m40_bpe_free(b);
    return NULL;
}

void m40_bpe_free(m40_bpe *b)
{
    if (!b)
        return;
    for (int i = 0; i < b->n_regex; i++)
        pcre2_code_free(b->re[i]);
    free(b->raw);
    free(b->pieces);
    free(b->arena);
    free(b->str_slots);
    free(b->merge_slots);
    free(b);
}

const char *m40_bpe_pre_name(const m40_bpe *b)
{
    return b ? b->pre : NULL;
}

const char *m40_bpe_load_warning(const m40_bpe *b)
{
    return b && b->load_warning[0] ? b->load_warning : NULL;
}

/* ---------------------------------------------------------------------------------- */
/* Encoding.                                                                           */

typedef struct {
    int32_t rank, left, right, lid, rid;
} m40_bpe_cand;

typedef struct {
    const m40_bpe *b;
    const char *text;
    int32_t *ids;
    int64_t cap, count;
    int oom;
    pcre2_match_data *md;
    /* per-word scratch, grown as needed and reused across words */
    size_t scap;
    int32_t *sym, *prev, *next, *start;
    m40_bpe_cand *heap;
    size_t hcap, hn;
    char *mapped;
} m40_bpe_ctx;

static void m40_bpe_emit(m40_bpe_ctx *c, int32_t id)
{
    /* Pieces past the vocabulary (possible only for a byte missing from a malformed
     * vocab) have no token to emit. */
    if (id < 0 || id >= c->b->n_vocab)
        return;
    if (c->count < c->cap)
        c->ids[c->count] = id;
    c->count++;
}

static int m40_bpe_cand_less(const m40_bpe_cand *a, const m40_bpe_cand *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static void m40_bpe_heap_push(m40_bpe_ctx *c, m40_bpe_cand v)
{
    size_t i = c->hn++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!m40_bpe_cand_less(&v, &c->heap[p]))
            break;
        c->heap[i] = c->heap[p];
        i = p;
    }
    c->heap[i] = v;
}

static m40_bpe_cand m40_bpe_heap_pop(m40_bpe_ctx *c)
{
    m40_bpe_cand top = c->heap[0], last = c->heap[--c->hn];
    size_t i = 0, n = c->hn;
    for (;;) {
        size_t l = 2 * i + 1, m = i;
        const m40_bpe_cand *best = &last;
        if (l < n && m40_bpe_cand_less(&c->heap[l], best)) {
            m = l;
            best = &c->heap[l];
        }
        if (l + 1 < n && m40_bpe_cand_less(&c->heap[l + 1], best))
            m = l + 1;
        if (m == i)
            break;
        c->heap[i] = c->heap[m];
        i = m;
    }
    if (n)
        c->heap[i] = last;
    return top;
}

static void m40_bpe_try_pair(m40_bpe_ctx *c, int32_t l, int32_t r)
{
    if (l < 0 || r < 0)
        return;
    const m40_bpe_merge_slot *m = m40_bpe_find_merge(c->b, c->sym[l], c->sym[r]);
    if (!m)
        return;
    m40_bpe_cand v = {m->rank, l, r, c->sym[l], c->sym[r]};
    m40_bpe_heap_push(c, v);
}

static int m40_bpe_reserve(m40_bpe_ctx *c, size_t n)
{
    if (n <= c->scap)
        return 0;
    size_t cap = c->scap ? c->scap : 64;
    while (cap < n)
        cap *= 2;
    int32_t *p[4] = {c->sym, c->prev, c->next, c->start};
    for (int k = 0; k < 4; k++) {
        int32_t *np = realloc(p[k], cap * sizeof *np);
        if (!np)
            return -1;
        p[k] = np;
    }
    c->sym = p[0], c->prev = p[1], c->next = p[2], c->start = p[3];
    /* each merge pushes at most two candidates: 3n bounds the heap */
    m40_bpe_cand *h = realloc(c->heap, cap * 3 * sizeof *h);
    if (!h)
        return -1;
    c->heap = h;
    char *mp = realloc(c->mapped, cap * 2);
    if (!mp)
        return -1;
    c->mapped = mp;
    c->scap = cap;
    return 0;
}

static void m40_bpe_word(m40_bpe_ctx *c, size_t off, size_t n)
{
    const m40_bpe *b = c->b;
    const unsigned char *w = (const unsigned char *)c->text + off;
    if (n == 0)
        return;
    if (n == 1) {
        m40_bpe_emit(c, b->byte_piece[w[0]]);
        return;
    }
    if (n > INT32_MAX / 4 || m40_bpe_reserve(c, n) != 0) {
        c->oom = 1;
        return;
    }
    if (b->ignore_merges) {
        size_t m = 0;
        for (size_t i = 0; i < n; i++)
            m += m40_bpe_utf8_put(c->mapped + m, b->byte_to_cp[w[i]]);
        int32_t id = m40_bpe_find_piece(b, c->mapped, m);
        if (id >= 0 && id < b->n_vocab) {
            m40_bpe_emit(c, id);
            return;
        }
    }
    int32_t sn = (int32_t)n;
    for (int32_t i = 0; i < sn; i++) {
        c->sym[i] = b->byte_piece[w[i]];
        c->prev[i] = i - 1;
        c->next[i] = i + 1 < sn ? i + 1 : -1;
        c->start[i] = i;
    }
    c->hn = 0;
    for (int32_t i = 0; i + 1 < sn; i++)
        m40_bpe_try_pair(c, i, i + 1);
    while (c->hn) {
        m40_bpe_cand v = m40_bpe_heap_pop(c);
        /* Stale candidates (a side already merged into something else) are skipped:
         * the right symbol is dead (sym -1) or the ids no longer match. */
        if (c->sym[v.left] != v.lid || c->sym[v.right] != v.rid || c->next[v.left] != v.right)
            continue;
        const m40_bpe_merge_slot *m = m40_bpe_find_merge(b, v.lid, v.rid);
        c->sym[v.left] = m->result;
        c->sym[v.right] = -1;
        int32_t nx = c->next[v.right];
        c->next[v.left] = nx;
        if (nx >= 0)
            c->prev[nx] = v.left;
        m40_bpe_try_pair(c, c->prev[v.left], v.left);
        m40_bpe_try_pair(c, v.left, nx);
    }
    for (int32_t i = 0; i >= 0; i = c->next[i]) {
        int32_t id = c->sym[i];
        if (id < b->n_vocab) {
            m40_bpe_emit(c, id);
        } else {
            int32_t end = c->next[i] >= 0 ? c->next[i] : sn;
            for (int32_t k = i; k < end; k++)
                m40_bpe_emit(c, b->byte_piece[w[k]]);
        }
    }
}

/* Offset of the first character start after position p (continuation bytes skipped,
 * at most three, so stray continuation bytes in invalid text cannot stall). */
static size_t m40_bpe_next_char(const char *s, size_t len, size_t p)
{
    size_t q = p + 1;
    for (int k = 0; k < 3 && q < len && ((unsigned char)s[q] & 0xC0) == 0x80; k++)
        q++;
    return q;
}

static void m40_bpe_split(m40_bpe_ctx *c, int k, size_t off, size_t len)
{
    if (len == 0 || c->oom)
        return;
    if (k == c->b->n_regex) {
        m40_bpe_word(c, off, len);
        return;
    }
    const char *s = c->text + off;
    size_t pos = 0, seg = 0;
    while (pos <= len && !c->oom) {
        int rc = pcre2_match(c->b->re[k], (PCRE2_SPTR)s, len, pos, 0, c->md, NULL);
        if (rc < 0 && rc != PCRE2_ERROR_NOMATCH)
            /* A JIT stack or match limit on a pathological input: retry interpreted. */
            rc = pcre2_match(c->b->re[k], (PCRE2_SPTR)s, len, pos, PCRE2_NO_JIT, c->md, NULL);
        if (rc < 0)
            break; /* no match (or still a limit): the rest stays one unmatched piece */
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(c->md);
        size_t ms = ov[0], me = ov[1];
        if (ms < seg || me < ms || me > len)
            break;
        if (c->b->digit_groups[k]) {
            /* Boundaries only (no isolated gaps): before every digit from which the rest
             * of its run is a positive multiple of three digits long. */
            size_t left = 0;
            for (size_t i = ms; i < me; i++)
                left += ((unsigned char)s[i] & 0xC0) != 0x80;
            for (size_t i = ms; i < me; i++) {
                if (((unsigned char)s[i] & 0xC0) == 0x80)
                    continue;
                if (left % 3 == 0 && i > seg) {
                    m40_bpe_split(c, k + 1, off + seg, i - seg);
                    seg = i;
                }
                left--;
            }
            if (me == ms)
                break; /* "\\d+" never matches empty; guard against looping anyway */
            pos = me;
            continue;
        }
        if (ms > seg)
            m40_bpe_split(c, k + 1, off + seg, ms - seg);
        if (me > ms) {
            m40_bpe_split(c, k + 1, off + ms, me - ms);
            seg = pos = me;
        } else {
            /* An empty match only marks a boundary; search on from the next char. */
            seg = ms;
            if (ms >= len)
                break;
            pos = m40_bpe_next_char(s, len, ms);
        }
    }
    if (seg < len)
        m40_bpe_split(c, k + 1, off + seg, len - seg);
}

int64_t m40_bpe_encode(const m40_bpe *b, const char *text, size_t len, int32_t *ids, int64_t cap)
{
    if (!b)
        return -1;
    m40_bpe_ctx c;
    memset(&c, 0, sizeof c);
    c.b = b;
    c.text = text;
    c.ids = ids;
    c.cap = ids ? cap : 0;
    if (len == 0)
        return 0;
    if (!text)
        return -1;
    /* Match data per call, so that one m40_bpe can serve several threads at once. */
    c.md = pcre2_match_data_create(16, NULL);
    if (!c.md)
        return -1;
    m40_bpe_split(&c, 0, 0, len);
    pcre2_match_data_free(c.md);
    free(c.sym);
    free(c.prev);
    free(c.next);
    free(c.start);
    free(c.heap);
    free(c.mapped);
    return c.oom ? -1 : c.count;
}

/* Normal tokens are byte-mapped text and are mapped back. Control and user-defined
 * tokens (tokenizer.ggml.token_type 3 and 4) hold plain text, as the reference
 * tokenizers decode them: e.g. NeoX's whitespace-run tokens or DeepSeek's added "\xC3\xBC"
 * ("u-umlaut") token, which must decode to that character, not to byte 0xFC. */
int m40_bpe_token_bytes(const m40_bpe *b, int32_t id, char *buf, int cap)
{
    if (!b || id < 0 || id >= b->n_vocab)
        return -1;
    const m40_bpe_piece *p = &b->pieces[id];
    const unsigned char *s = (const unsigned char *)b->arena + p->off;
    size_t n = p->len, i = 0;
    int out = 0;
    if (b->raw[id]) {
        if (n > INT32_MAX)
            return -1;
        size_t room = cap > 0 ? (size_t)cap : 0;
        if (room)
            memcpy(buf, s, n < room ? n : room);
        return (int)n;
    }
    while (i < n) {
        /* Decode one UTF-8 char; a mapped char U+0000..U+0143 gives back its byte, any
         * other char (or invalid byte) of the token string is copied as it stands. */
        uint32_t cp = s[i];
        size_t cl = 1;
        if (s[i] >= 0xC0 && s[i] < 0xE0 && i + 1 < n && (s[i + 1] & 0xC0) == 0x80) {
            cp = ((uint32_t)(s[i] & 0x1F) << 6) | (s[i + 1] & 0x3F);
            cl = 2;
        } else if (s[i] >= 0x80) {
            cp = UINT32_MAX; /* 3-4 byte chars are never mapped bytes */
            cl = 1;
            if (s[i] >= 0xE0) {
                size_t want = s[i] >= 0xF0 ? 4 : 3;
                size_t k = 1;
                while (k < want && i + k < n && (s[i + k] & 0xC0) == 0x80)
                    k++;
                cl = k;
            }
        }
        if (cp < 324 && b->cp_to_byte[cp] >= 0 && (cl == 2 || cp < 0x80)) {
            if (out < cap)
                buf[out] = (char)b->cp_to_byte[cp];
            out++;
        } else {
            for (size_t k = 0; k < cl; k++) {
                if (out < cap)
                    buf[out] = (char)s[i + k];
                out++;
            }
        }
        i += cl;
    }
    return out;
}
