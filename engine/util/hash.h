/* FNV-1a, 64 bits: a fast, well-spread hash of a byte string with no table and no
 * dependency. One definition for the engine's hash tables (GGUF tensor names, BPE and
 * SentencePiece pieces, mkmodel's per-tensor seeds) and the module's $m40_prefix_hash. */
#ifndef M40_HASH_H
#define M40_HASH_H

#include <stddef.h>
#include <stdint.h>

uint64_t m40_fnv1a64(const void *data, size_t len);

#endif
