/* Tokenizers selected by the GGUF's tokenizer.ggml.model:
 *   "llama" -> SentencePiece through libsentencepiece (model proto built from the GGUF
 *              vocabulary: pieces, scores, types, byte fallback), or a .model file;
 *   "gpt2"  -> byte-level BPE in C, pre-tokenizer regexes (PCRE2) chosen by
 *              tokenizer.ggml.pre.
 * Control tokens are recognized in text only when the caller asks (chat templates). */
#ifndef M40_TOKENIZER_H
#define M40_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "gguf/gguf.h"

typedef struct m40_tokenizer m40_tokenizer;

enum m40_tok_kind { M40_TOK_SPM = 1, M40_TOK_BPE = 2 };

/* GGUF token types (tokenizer.ggml.token_type). */
enum m40_token_type {
    M40_TOKEN_NORMAL = 1,
    M40_TOKEN_UNKNOWN = 2,
    M40_TOKEN_CONTROL = 3,
    M40_TOKEN_USER_DEFINED = 4,
    M40_TOKEN_UNUSED = 5,
    M40_TOKEN_BYTE = 6,
};

/* Build from a GGUF's vocabulary. -1 with a message in err on failure (missing keys,
 * unknown tokenizer.ggml.model or tokenizer.ggml.pre named in the message, ...). The
 * tokenizer copies what it needs: the m40_gguf may be closed afterwards. */
int m40_tokenizer_from_gguf(const m40_gguf *g, m40_tokenizer **out, char *err, size_t errlen);
/* SentencePiece .model file (serialized ModelProto). */
int m40_tokenizer_from_spm_file(const char *path, m40_tokenizer **out, char *err, size_t errlen);
void m40_tokenizer_free(m40_tokenizer *t);

int m40_tokenizer_kind(const m40_tokenizer *t);
/* What the load had to fall back on, as one line for the log (a BPE vocabulary without
 * tokenizer.ggml.pre gets llama.cpp's "default" pre-tokenizer), or NULL. Printing is the
 * caller's: the model loader and `m40 tokenize` log it once per load. */
const char *m40_tokenizer_load_warning(const m40_tokenizer *t);
int32_t m40_tokenizer_n_vocab(const m40_tokenizer *t);
/* The longest vocabulary piece in bytes as stored (at least what one token decodes to):
 * a text of n bytes tokenizes to at least n / this many tokens. Found once at load. */
size_t m40_tokenizer_max_piece_len(const m40_tokenizer *t);
int32_t m40_tokenizer_bos(const m40_tokenizer *t);     /* -1 if none */
int32_t m40_tokenizer_eos(const m40_tokenizer *t);     /* -1 if none */
int m40_tokenizer_add_bos(const m40_tokenizer *t);     /* tokenizer.ggml.add_bos_token, or the family default */
int m40_tokenizer_token_type(const m40_tokenizer *t, int32_t id);
/* 1 for ids that end generation (eos, eot, <|im_end|>, <end_of_turn>, ...; in a harmony
 * vocabulary (gpt-oss) <|return|> and <|call|>, not <|end|>). */
int m40_tokenizer_is_eog(const m40_tokenizer *t, int32_t id);
/* Id of an exact piece string (e.g. "<|im_end|>"), or -1. */
int32_t m40_tokenizer_find_piece(const m40_tokenizer *t, const char *piece);
/* Raw vocabulary piece (as stored), NUL-terminated; NULL for an id out of range. */
const char *m40_tokenizer_piece(const m40_tokenizer *t, int32_t id);

/* Encode len bytes of text. add_bos: prepend BOS (when the vocabulary has one).
 * parse_special: also split out control-token strings as single ids (only for trusted
 * template output, never for user text). User-defined tokens (type 4: added words such
 * as mpt's whitespace runs) are always matched in text, as their reference tokenizers do. Returns the number of ids written
 * into ids[0..cap) — when it exceeds cap, call again with a larger buffer — or -1 on
 * error (message in err, e.g. allocation failure). Invalid UTF-8 in text never crashes:
 * SPM falls back to bytes, BPE encodes bytes. */
int64_t m40_tokenize(const m40_tokenizer *t, const char *text, size_t len, int add_bos, int parse_special,
                     int32_t *ids, int64_t cap, char *err, size_t errlen);

/* m40_tokenize with parse_special on for the template's markup and off inside the
 * protected byte ranges of text (n_protect pairs [protect[2k], protect[2k+1]), sorted and
 * disjoint): the text of the conversation's messages. A control-token string typed in a
 * message stays text there, and no control token may start in a range or reach into
 * one; user-defined tokens inside a range still match, as in plain text. */
int64_t m40_tokenize_guarded(const m40_tokenizer *t, const char *text, size_t len, int add_bos,
                             const size_t *protect, size_t n_protect, int32_t *ids, int64_t cap, char *err,
                             size_t errlen);
/* 1 when text contains the string of a control token (one parse_special would split
 * out), else 0. */
int m40_tokenizer_has_control(const m40_tokenizer *t, const char *text, size_t len);

/* Bytes of one token as it appears in decoded text (SPM: "▁" -> " ", <0xNN> -> byte;
 * BPE: byte-level mapping undone; control tokens -> "" unless render_special, except
 * harmony's message markers <|start|> <|channel|> <|message|> <|constrain|> <|end|>,
 * which are the structure of gpt-oss's output and decode to their text).
 * Returns the byte count (may exceed cap: nothing beyond cap is written). */
int m40_token_to_bytes(const m40_tokenizer *t, int32_t id, int render_special, char *buf, int cap);

/* Incremental, UTF-8 safe detokenizer for streaming: push token ids, get back only
 * complete UTF-8 sequences; an incomplete tail is held until later bytes complete it
 * (invalid sequences are emitted as U+FFFD). SPM: the leading space of the first
 * token after BOS is stripped, as SentencePiece decoding does. */
typedef struct m40_detok m40_detok;
m40_detok *m40_detok_new(const m40_tokenizer *t);
void m40_detok_free(m40_detok *d);
/* Appends token bytes; returns a pointer to the newly completed text and its length
 * in *n (valid until the next call). */
const char *m40_detok_push(m40_detok *d, int32_t id, size_t *n);
/* Flush any held bytes at end of stream (incomplete tail becomes U+FFFD). */
const char *m40_detok_flush(m40_detok *d, size_t *n);

#endif
