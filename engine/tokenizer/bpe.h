/* Byte-level BPE ("gpt2" tokenizer model): the pre-tokenizer regexes of the common
 * tokenizer.ggml.pre values through PCRE2, then rank-ordered merges over the
 * byte-to-unicode mapped pieces. Plain text only: special tokens are split out by the
 * caller (tokenizer.c) before text reaches here. */
#ifndef M40_BPE_H
#define M40_BPE_H

#include <stddef.h>
#include <stdint.h>

#include "gguf/gguf.h"

typedef struct m40_bpe m40_bpe;

/* Reads tokenizer.ggml.tokens, tokenizer.ggml.merges and tokenizer.ggml.pre. A missing or
 * empty pre reads as "default", llama.cpp's fallback pre-tokenizer, and leaves a load
 * warning; an unknown pre value, or one that is not a string, fails with it named in err. */
m40_bpe *m40_bpe_new(const m40_gguf *g, char *err, size_t errlen);
void m40_bpe_free(m40_bpe *b);
const char *m40_bpe_pre_name(const m40_bpe *b);
/* One line for the load log when the file needed a fallback (a missing pre), else NULL.
 * The library prints nothing itself: its callers log it once per load. */
const char *m40_bpe_load_warning(const m40_bpe *b);

/* Encode len bytes (any bytes; invalid UTF-8 is encoded bytewise, never crashes).
 * Writes up to cap ids, returns the total count (> cap: call again with more room),
 * -1 on allocation failure. */
int64_t m40_bpe_encode(const m40_bpe *b, const char *text, size_t len, int32_t *ids, int64_t cap);

/* Bytes of a token with the byte-level mapping undone (control and user-defined tokens
 * are returned as stored: their text was never byte-mapped) (may be a partial UTF-8
 * sequence). Returns the byte count (may exceed cap; nothing past cap written),
 * -1 for an id out of range. */
int m40_bpe_token_bytes(const m40_bpe *b, int32_t id, char *buf, int cap);

#endif
