/* The model store that `m40 pull` fills and `m40 list`, `m40 rm`, `m40 serve`, `m40 run`
 * read. Layout (README.md, "Model store"):
 *
 *   $M40_MODELS/ORG/REPO/FILE.gguf           a complete, verified model file
 *   $M40_MODELS/ORG/REPO/FILE.gguf.sha256    its sha256 ("HEX  FILE.gguf", sha256sum -c format)
 *   $M40_MODELS/ORG/REPO/FILE.gguf.partial   a download in progress (resumed with HTTP Range)
 *
 * FILE keeps the hub's path inside the repository (it may hold folders). A split model
 * (NAME-00001-of-0000N.gguf ...) is all its shards, named by the first. A file counts as
 * present only once its .sha256 is written, which pull does after the checksum and the
 * GGUF check passed; the .gguf is renamed into place just before. */
#ifndef M40_CLI_STORE_H
#define M40_CLI_STORE_H

#include <limits.h>
#include <stddef.h>
#include <stdint.h>

/* $M40_MODELS, else $XDG_CACHE_HOME/m40/models, else $HOME/.cache/m40/models. 0 or -1. */
int m40_store_dir(char *out, size_t len);

/* mkdir -p of the folder part of path (everything before the last '/'). 0, or -1 with errno. */
int m40_store_mkdirs_for(const char *path);

/* Recognizes a split GGUF's name, "...-00002-of-00005.gguf": 1 with *index, *count and
 * *prefix_len (the length before "-00002") set, else 0. */
int m40_split_name(const char *name, int *index, int *count, size_t *prefix_len);

/* 1 when QUANT (e.g. "q4_k_m") appears in the file name's last component as a whole
 * word, case-insensitive: after the start or '-', '.', '_', before the end or '-', '.'
 * (so "Q4_K" does not pick "Q4_K_M" and "Q8_0" not "IQ8_0"). */
int m40_quant_match(const char *file, const char *quant);

/* llama.cpp's general.file_type name ("Q4_K_M"), or NULL. */
const char *m40_ftype_name(uint32_t ftype);

typedef struct {
    char name[PATH_MAX];  /* ORG/REPO/FILE.gguf, relative to the store */
    char path[PATH_MAX];  /* absolute path of the (first) file */
    uint64_t size;        /* bytes, all shards */
    int shards;           /* 1, or the split's count */
    int shards_present;   /* complete shards found */
} m40_store_entry;

/* Every complete model of the store, sorted by name. 0 (with *out malloc'd, maybe
 * NULL when *n is 0), or -1 when the store cannot be read (a missing store is empty). */
int m40_store_scan(m40_store_entry **out, size_t *n);

/* What a model argument names: an existing file as it is; else a store name, tried as
 * ORG/REPO/FILE.gguf, ORG/REPO/FILE (no .gguf), ORG/REPO:QUANT, ORG/REPO (one model
 * there), FILE or FILE.gguf (one in the whole store). Writes the path and returns 0;
 * -1 when nothing matches, -2 when the name is ambiguous or the model incomplete, with
 * the reason in err. */
int m40_store_resolve(const char *arg, char *path, size_t pathlen, char *err, size_t errlen);

/* For the commands that take a MODEL: the resolved path, or arg itself (then its
 * loader reports the missing file), after printing why the store did not help when
 * the argument looked like a store name. buf holds the result. */
const char *m40_model_arg(const char *cmd, const char *arg, char *buf, size_t len);

#endif
