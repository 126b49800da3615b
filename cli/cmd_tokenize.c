/* m40 tokenize [--no-bos] [--special] MODEL TEXT|-
 * Prints the token ids of TEXT as one JSON array ("[1, 15043, 3186]"). MODEL is a GGUF
 * file (its tokenizer.ggml.* vocabulary) or a SentencePiece .model file, told apart by
 * the GGUF magic. TEXT "-" reads stdin as raw bytes. Control-token strings in the text
 * are plain text unless --special is given (the way chat-template output is encoded). */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "store.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

static int tokenize_usage(void)
{
    fprintf(stderr, "usage: m40 tokenize [--no-bos] [--special] MODEL TEXT|-\n"
                    "  MODEL    a GGUF file or a SentencePiece .model file\n"
                    "  TEXT     text to encode; - reads raw bytes from stdin\n"
                    "  --no-bos do not prepend BOS (by default the vocabulary's add_bos setting applies)\n"
                    "  --special recognize control-token strings such as <s> in the text\n");
    return 2;
}

static char *read_stdin(size_t *len)
{
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    if (!buf)
        return NULL;
    for (;;) {
        if (n == cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                return NULL;
            }
            buf = nb;
            cap *= 2;
        }
        size_t got = fread(buf + n, 1, cap - n, stdin);
        n += got;
        if (got == 0)
            break;
    }
    if (ferror(stdin)) {
        free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}

/* 1 when the file starts with the GGUF magic, 0 when not, -1 when it cannot be read. */
static int is_gguf_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    char magic[4] = {0};
    size_t got = fread(magic, 1, 4, f);
    fclose(f);
    return got == 4 && !memcmp(magic, "GGUF", 4);
}

static int load_tokenizer(const char *path, m40_tokenizer **tok, char *err, size_t errlen)
{
    int g = is_gguf_file(path);
    if (g < 0) {
        snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    if (!g)
        return m40_tokenizer_from_spm_file(path, tok, err, errlen);
    m40_gguf *gg;
    if (m40_gguf_open(path, &gg, err, errlen) != 0)
        return -1;
    int rc = m40_tokenizer_from_gguf(gg, tok, err, errlen);
    m40_gguf_close(gg);
    /* The ids printed depend on the fallback: say so, as llama.cpp's tools do. */
    const char *warning = rc == 0 ? m40_tokenizer_load_warning(*tok) : NULL;
    if (warning)
        fprintf(stderr, "m40 tokenize: warning: %s\n", warning);
    return rc;
}

int m40_cmd_tokenize(int argc, char **argv)
{
    int no_bos = 0, special = 0, i = 1;
    for (; i < argc && argv[i][0] == '-' && argv[i][1]; i++) {
        if (!strcmp(argv[i], "--no-bos"))
            no_bos = 1;
        else if (!strcmp(argv[i], "--special"))
            special = 1;
        else if (!strcmp(argv[i], "--"))
            { i++; break; }
        else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help"))
            return tokenize_usage();
        else {
            fprintf(stderr, "m40 tokenize: unknown option %s\n", argv[i]);
            return tokenize_usage();
        }
    }
    if (argc - i != 2)
        return tokenize_usage();
    char stored[PATH_MAX];
    const char *model = m40_model_arg("tokenize", argv[i], stored, sizeof stored), *arg = argv[i + 1];

    char err[512] = "";
    m40_tokenizer *tok = NULL;
    if (load_tokenizer(model, &tok, err, sizeof err) != 0) {
        fprintf(stderr, "m40 tokenize: %s\n", err);
        return 1;
    }
    char *text;
    size_t len;
    char *owned = NULL;
    if (!strcmp(arg, "-")) {
        owned = read_stdin(&len);
        if (!owned) {
            fprintf(stderr, "m40 tokenize: cannot read stdin\n");
            m40_tokenizer_free(tok);
            return 1;
        }
        text = owned;
    } else {
        text = (char *)arg;
        len = strlen(arg);
    }

    int add_bos = !no_bos && m40_tokenizer_add_bos(tok);
    int rc = 1;
    /* One try with a guess; a count beyond it tells the exact size for the second. */
    int64_t cap = (int64_t)len + 16;
    int32_t *ids = NULL;
    int64_t n = -1;
    for (int attempt = 0; attempt < 2; attempt++) {
        int32_t *nids = realloc(ids, (size_t)cap * sizeof *ids);
        if (!nids) {
            fprintf(stderr, "m40 tokenize: out of memory\n");
            goto out;
        }
        ids = nids;
        n = m40_tokenize(tok, text, len, add_bos, special, ids, cap, err, sizeof err);
        if (n < 0) {
            fprintf(stderr, "m40 tokenize: %s\n", err);
            goto out;
        }
        if (n <= cap)
            break;
        cap = n;
    }
    if (n > cap) {
        fprintf(stderr, "m40 tokenize: token count changed between calls\n");
        goto out;
    }
    putchar('[');
    for (int64_t k = 0; k < n; k++)
        printf(k ? ", %d" : "%d", (int)ids[k]);
    puts("]");
    rc = fflush(stdout) == 0 ? 0 : 1;
out:
    free(ids);
    free(owned);
    m40_tokenizer_free(tok);
    return rc;
}
