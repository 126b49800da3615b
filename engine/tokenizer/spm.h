/* SentencePiece ("llama" tokenizer model) through libsentencepiece. spm_shim.cc is the
 * only C++ in the project: a thin C API over sentencepiece::SentencePieceProcessor.
 * spm_proto.c serializes a ModelProto (protobuf wire format, written directly, so no
 * protobuf dependency) from the GGUF vocabulary: pieces, scores, types, byte fallback. */
#ifndef M40_SPM_H
#define M40_SPM_H

#include <stddef.h>
#include <stdint.h>

#include "gguf/gguf.h"

typedef struct m40_spm m40_spm;

/* --- spm_shim.cc: C API over the C++ processor --- */
m40_spm *m40_spm_load_proto(const void *proto, size_t len, char *err, size_t errlen);
m40_spm *m40_spm_load_file(const char *path, char *err, size_t errlen);
void m40_spm_free(m40_spm *s);
int32_t m40_spm_n_pieces(const m40_spm *s);
/* Piece string of an id (NUL-terminated, owned by s), NULL out of range. */
const char *m40_spm_piece(const m40_spm *s, int32_t id);
float m40_spm_score(const m40_spm *s, int32_t id);
/* Encode plain text (no BOS, no special-token parsing). Same return convention as
 * m40_bpe_encode: total count, may exceed cap; -1 on error (message in err). */
int64_t m40_spm_encode(const m40_spm *s, const char *text, size_t len, int32_t *ids, int64_t cap,
                       char *err, size_t errlen);

/* --- spm_proto.c: ModelProto from a GGUF vocabulary --- */
/* Returns a malloc'd serialized ModelProto in *out / *out_len, or -1 with err. */
int m40_spm_proto_from_gguf(const m40_gguf *g, unsigned char **out, size_t *out_len, char *err, size_t errlen);

#endif
